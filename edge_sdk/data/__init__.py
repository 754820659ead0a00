"""Datasets, federated partitions and per-device train/test data, loadable with numpy only."""

from edge_sdk.data.client_data import ClientData, load_client_data, load_folder_data
from edge_sdk.data.datasets import (
    DATASETS,
    Dataset,
    DatasetMeta,
    DatasetNotFoundError,
    load_dataset,
)
from edge_sdk.data.domains import DOMAIN_TRANSFORMS, apply_domain
from edge_sdk.data.partition import PARTITIONS, partition_indices, stratified_split

__all__ = [
    "ClientData",
    "DATASETS",
    "DOMAIN_TRANSFORMS",
    "Dataset",
    "DatasetMeta",
    "DatasetNotFoundError",
    "PARTITIONS",
    "apply_domain",
    "load_client_data",
    "load_dataset",
    "load_folder_data",
    "partition_indices",
    "stratified_split",
]
