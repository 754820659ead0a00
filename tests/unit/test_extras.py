"""The `edgepfl` command's missing-extra line: which modules it reports and which failures keep
their traceback. (The commands on real installs of the wheel: tests/integration/test_wheel_installs.py.)"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from coordinator import cli, extras
from edge_sdk.config import load_toml

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_optional_module_is_installed_by_the_extra_it_names():
    optional = load_toml(str(ROOT / "pyproject.toml"))["project"]["optional-dependencies"]
    for top, module in extras.OPTIONAL_MODULES.items():
        direct = {_name(r) for r in optional[module.extra]}
        # a module an extra brings through one of its packages (Pillow through torchvision)
        indirect = {_name(r) for dist in direct for r in (metadata.requires(dist) or []) if "extra ==" not in r}
        assert module.dist in direct | indirect, f"{top}: {module.dist} is not installed by edgepfl[{module.extra}]"


def _run_broker_raising(monkeypatch, error: BaseException) -> int:
    def broker(args):
        raise error

    monkeypatch.setattr(cli, "cmd_broker", broker)
    return cli.main(["broker"])


def test_an_absent_optional_module_ends_in_one_line_naming_its_extra(monkeypatch, capsys):
    monkeypatch.setitem(extras.OPTIONAL_MODULES, "edgepfl_absent_module",
                        extras.OptionalModule("Absent", "edgepfl-absent", "broker"))

    code = _run_broker_raising(monkeypatch, ModuleNotFoundError("no", name="edgepfl_absent_module.part"))

    assert code == cli.USAGE_ERROR
    assert capsys.readouterr().err.splitlines() == ['edgepfl broker needs Absent: pip install "edgepfl[broker]"']


@pytest.mark.parametrize("error", [
    ModuleNotFoundError("No module named 'torch._absent_part'", name="torch._absent_part"),  # torch is installed
    ModuleNotFoundError("No module named 'edgepfl_unknown'", name="edgepfl_unknown"),  # not an optional module
    ModuleNotFoundError("raised by hand"),  # no module name
    ImportError("cannot import name 'x' from 'torch'", name="torch"),  # not a missing module
], ids=["installed", "unknown", "unnamed", "import-error"])
def test_other_import_failures_are_not_reported_as_a_missing_extra(monkeypatch, capsys, error):
    with pytest.raises(ImportError) as raised:
        _run_broker_raising(monkeypatch, error)

    assert raised.value is error
    assert "pip install" not in capsys.readouterr().err


def test_a_device_is_not_sent_to_install_an_extra_it_does_not_run_for_its_data():
    absent = extras.OptionalModule("scikit-learn", "scikit-learn", "train")
    error = ModuleNotFoundError("No module named 'edgepfl_absent_sklearn'", name="edgepfl_absent_sklearn")

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(extras.OPTIONAL_MODULES, "edgepfl_absent_sklearn", absent)
        trainer = str(extras.missing_for_data(error, "client", "digits"))
        weak = str(extras.missing_for_data(error, "lite-client", "digits"))
        own = str(extras.missing_for_data(error, "lite-client", None))

    assert trainer == ('edgepfl client --dataset digits needs scikit-learn: pip install "edgepfl[train]", or give '
                       "the device's own data with --data")
    assert weak == ("edgepfl lite-client --dataset digits needs scikit-learn: pip install scikit-learn, or give "
                    "the device's own data with --data")
    assert own == "edgepfl lite-client --data needs scikit-learn to read this data: pip install scikit-learn"
