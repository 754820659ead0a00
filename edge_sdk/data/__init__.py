"""Tasks, datasets, federated partitions and per-device train/test data, loadable with numpy only."""

from edge_sdk.data.client_data import ClientData, device_seed, load_client_data, load_folder_data, partition_client_data
from edge_sdk.data.datasets import BUILTIN_TASKS, Dataset, DatasetNotFoundError, load_dataset
from edge_sdk.data.domains import DOMAIN_TRANSFORMS, apply_domain
from edge_sdk.data.partition import PARTITIONS, partition_indices, stratified_split
from edge_sdk.data.resolve import DECLARABLE, resolve_task
from edge_sdk.data.task import TASK_KINDS, TaskSpec
from edge_sdk.data.user_data import dataset_from_arrays, infer_task, load_user_dataset, read_user_data

__all__ = [
    "BUILTIN_TASKS",
    "ClientData",
    "DECLARABLE",
    "DOMAIN_TRANSFORMS",
    "Dataset",
    "DatasetNotFoundError",
    "PARTITIONS",
    "TASK_KINDS",
    "TaskSpec",
    "apply_domain",
    "dataset_from_arrays",
    "device_seed",
    "infer_task",
    "load_client_data",
    "load_dataset",
    "load_folder_data",
    "load_user_dataset",
    "partition_client_data",
    "partition_indices",
    "read_user_data",
    "resolve_task",
    "stratified_split",
]
