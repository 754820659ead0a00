"""What a curious or malicious server cannot get: masked uploads look uniform, no secret crosses the
wire in the clear, devices refuse inconsistent unmask requests and substituted keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from edge_sdk.secagg import IdentityKey, KeyAdvertisement, SecAggError
from edge_sdk.secagg.masks import public_raw
from secagg_rounds import (AFTER_SHARE, advertise, confirm, mask, play, random_inputs, round_context, share_keys,
                           start_round)

# The chi-square statistic with 255 degrees of freedom exceeded with probability 1e-6.
CHI_SQUARE_255_P_1E_6 = 377.08


def byte_chi_square(vector: np.ndarray) -> float:
    counts = np.bincount(vector.view(np.uint8), minlength=256)
    expected = counts.sum() / 256
    return float(((counts - expected) ** 2 / expected).sum())


def masked_round(count: int = 6, threshold: int = 3, degree: int = 4, length: int = 100):
    """A round up to the masked uploads, every device taking part."""
    context = round_context(count, threshold, degree, length)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    devices = list(context.participants)
    share_keys(trial, devices, advertise(trial, devices))
    mask(trial, devices)
    return trial


def test_a_masked_upload_of_a_structured_update_looks_uniform():
    # Prepare: a very non-uniform update of 64k words
    context = round_context(count=5, threshold=3, degree=4, length=65536)
    update = (np.arange(65536, dtype=np.uint32) % 7) * 3
    trial = start_round(context, {device: update for device in context.participants})
    devices = list(context.participants)
    share_keys(trial, devices, advertise(trial, devices))

    # Execute
    masked = trial.clients["dev00"].mask(update)

    # Assert: the update itself fails the test by far; its masked upload passes it
    assert byte_chi_square(update) > 100 * CHI_SQUARE_255_P_1E_6
    assert byte_chi_square(masked) < CHI_SQUARE_255_P_1E_6


def test_no_message_carries_a_secret_in_the_clear():
    # Prepare: a round with a device dropping after sharing, so both kinds of share are revealed
    context = round_context(count=8, threshold=3, degree=4, length=64)
    trial = play(context, random_inputs(context, np.random.default_rng(5)), {"dev02": AFTER_SHARE})
    everything = b"".join(trial.packed)
    responses = b"".join(trial.packed_responses)
    hidden = trial.secrets

    # Assert: no message before unmasking holds a seed, a mask key or a share; no response a seed or key
    assert len(hidden.b_shares) > 8 and len(hidden.self_seeds) == 8
    for secret in [*hidden.self_seeds.values(), *hidden.mask_keys.values(), *hidden.b_shares.values(),
                   *hidden.s_shares.values()]:
        assert secret not in everything
    for secret in [*hidden.self_seeds.values(), *hidden.mask_keys.values()]:
        assert secret not in responses
    # the responses hold b shares of survivors and s shares of the dropped device only
    for (owner, holder), share in hidden.b_shares.items():
        assert (share in responses) == (owner in trial.server.survivors and holder in trial.responders)
    for (owner, holder), share in hidden.s_shares.items():
        assert (share in responses) == (owner == "dev02" and holder in trial.responders)


def signed_by_all(trial, survivors):
    """Every device's signature on `survivors`, as the server would forward them."""
    return {device: client.confirm(survivors).signature for device, client in trial.clients.items()
            if device in survivors}


def test_a_device_asked_for_both_shares_of_one_peer_reveals_nothing_and_answers_no_more():
    # Prepare
    trial = masked_round()
    device = trial.clients["dev00"]
    neighbours = sorted(device.shared_with)
    survivors = sorted(trial.context.participants)
    signatures = signed_by_all(trial, survivors)

    # Execute / Assert: the peer as survivor and dropped at once
    with pytest.raises(SecAggError, match=f"{neighbours[0]!r} as both survivor and dropped"):
        device.unmask(survivors, neighbours[:1], signatures)
    with pytest.raises(SecAggError, match="out of order"):
        device.unmask(survivors, [], signatures)


def test_a_second_unmask_request_is_refused():
    # Prepare
    trial = masked_round()
    confirm(trial, list(trial.context.participants))
    request = trial.server.unmask_request("dev01")
    device = trial.clients["dev01"]
    first = device.unmask(request.survivors, request.dropped, request.signatures)

    # Execute / Assert: even asking for the other kind of share of the same peers
    with pytest.raises(SecAggError, match="out of order"):
        device.unmask([], request.survivors, request.signatures)
    assert set(first.b_shares) == device.shared_with and not first.s_shares


def test_a_request_with_exactly_threshold_surviving_neighbours_is_answered():
    # Prepare: dev01 has 4 neighbours, threshold 3; the survivor set says one dropped, and all signed it
    trial = masked_round(count=6, threshold=3, degree=4)
    neighbours = sorted(trial.clients["dev01"].shared_with)
    survivors = sorted(set(trial.context.participants) - {neighbours[3]})
    signatures = signed_by_all(trial, survivors)

    # Execute
    response = trial.clients["dev01"].unmask(survivors, neighbours[3:], signatures)

    # Assert
    assert set(response.b_shares) == set(neighbours[:3]) and set(response.s_shares) == set(neighbours[3:])


@pytest.mark.parametrize(("change", "field"), [
    ("another set", "differs from the one 'dev01' signed"),
    ("dropped left out", "leaves out"),
    ("too few signatures", "2 neighbours of 'dev01' signed the survivor set, threshold is 3"),
    ("a forged signature", "does not verify"),
])
def test_an_inconsistent_unmask_request_is_refused(change, field):
    # Prepare: every device signed the survivor set without dev01's first neighbour
    trial = masked_round()
    client = trial.clients["dev01"]
    first = sorted(client.shared_with)[0]
    survivors = sorted(set(trial.context.participants) - {first})
    signatures = signed_by_all(trial, survivors)
    dropped = [first]
    if change == "another set":
        survivors = sorted(trial.context.participants)
    elif change == "dropped left out":
        dropped = []
    elif change == "too few signatures":
        signatures = {peer: signatures[peer] for peer in sorted(client.neighbours & set(signatures))[:2]}
    else:
        signatures[sorted(client.neighbours & set(signatures))[0]] = bytes(64)

    # Execute / Assert
    with pytest.raises(SecAggError, match=field):
        client.unmask(survivors, dropped, signatures)


def test_a_substituted_mask_key_is_detected_by_the_neighbours_naming_the_device():
    # Prepare: the server swaps dev01's s public key for one of its own
    context = round_context(count=6, threshold=3, degree=4, length=10)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    adverts = advertise(trial, list(context.participants))
    adverts["dev01"] = dataclasses.replace(adverts["dev01"], s_public=public_raw(X25519PrivateKey.generate()))

    # Execute / Assert: every device checks every advertisement (they all fix the graph seed)
    with pytest.raises(SecAggError, match="bad signature from device 'dev01'"):
        trial.clients["dev03"].share_keys(adverts)


def test_keys_re_signed_by_another_identity_are_rejected():
    # Prepare: the server forges dev01's advertisement with an identity key of its own
    context = round_context(count=6, threshold=3, degree=4, length=10)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    adverts = advertise(trial, list(context.participants))
    c_public, s_public = (public_raw(X25519PrivateKey.generate()) for _ in range(2))
    forged = IdentityKey.generate().sign(KeyAdvertisement.signed_payload(context, "dev01", c_public, s_public))
    adverts["dev01"] = KeyAdvertisement("dev01", c_public, s_public, forged)

    # Execute / Assert
    with pytest.raises(SecAggError, match="dev01"):
        trial.clients["dev04"].share_keys(adverts)
    with pytest.raises(SecAggError, match="alter 'dev01'"):
        trial.clients["dev01"].share_keys(adverts)


def test_misrouted_or_altered_ciphertexts_are_rejected_naming_the_sender():
    # Prepare: dev00 gets a ciphertext that was meant for another of the sender's neighbours
    context = round_context(count=8, threshold=3, degree=4, length=10)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    adverts = advertise(trial, list(context.participants))
    sender = sorted(trial.context.neighbours_of("dev00"))[0]
    other = sorted(trial.context.neighbours_of(sender) - {"dev00"})[0]
    misrouted = trial.clients[sender].share_keys(adverts)[other]
    for client in trial.clients.values():
        if client.client_id != sender:
            client.share_keys(adverts)

    # Execute / Assert
    with pytest.raises(SecAggError, match=f"ciphertext from {sender!r} does not decrypt"):
        trial.clients["dev00"].receive_shares({sender: misrouted})


def shared_round(length: int = 100):
    """A round in which every device has shared keys, none has masked yet."""
    context = round_context(6, 3, 4, length)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    devices = list(context.participants)
    share_keys(trial, devices, advertise(trial, devices))
    return trial


def test_the_server_refuses_a_masked_vector_of_the_wrong_length_type_or_sender():
    server = shared_round(length=100).server
    with pytest.raises(SecAggError, match="length 99"):
        server.add_masked("dev00", np.zeros(99, dtype=np.uint32))
    with pytest.raises(SecAggError, match="uint32"):
        server.add_masked("dev00", np.zeros(100, dtype=np.int32))
    with pytest.raises(SecAggError, match="'ghost', which did not share keys"):
        server.add_masked("ghost", np.zeros(100, dtype=np.uint32))
    server.add_masked("dev00", np.zeros(100, dtype=np.uint32))
    with pytest.raises(SecAggError, match="already sent"):
        server.add_masked("dev00", np.zeros(100, dtype=np.uint32))


def test_the_server_refuses_a_share_bundle_that_leaves_out_an_advertised_neighbour():
    # Prepare
    context = round_context(6, 3, 4, 100)
    trial = start_round(context, random_inputs(context, np.random.default_rng(0)))
    ciphertexts = trial.clients["dev00"].share_keys(advertise(trial, list(context.participants)))
    left_out = sorted(ciphertexts)[0]

    # Execute / Assert
    with pytest.raises(SecAggError, match=f"{left_out!r} is missing"):
        trial.server.route("dev00", {peer: data for peer, data in ciphertexts.items() if peer != left_out})
    assert "dev00" not in trial.server.shared


def test_a_closed_stage_accepts_nothing_more():
    # Prepare: masking closed by the survivor set
    trial = masked_round()
    trial.server.survivor_set()

    # Execute / Assert
    with pytest.raises(SecAggError, match="sharing stage is closed"):
        trial.server.route("dev00", {})
    with pytest.raises(SecAggError, match="masking stage is closed"):
        trial.server.add_masked("dev00", np.zeros(100, dtype=np.uint32))
    with pytest.raises(SecAggError, match="out of order"):
        trial.clients["dev00"].mask(np.zeros(100, dtype=np.uint32))
