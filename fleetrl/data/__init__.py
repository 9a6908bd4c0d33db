"""Prompt data: reading files, normalising schemas, tokenizing, mixing tasks, and collating batches."""
from fleetrl.data.collate import collate
from fleetrl.data.dataset import PromptDataset
from fleetrl.data.errors import DataError
from fleetrl.data.mixture import MixtureDataset, load_dataset
from fleetrl.data.readers import read_rows
from fleetrl.data.records import PromptRecord
from fleetrl.data.sampler import MixtureSampler
from fleetrl.data.schema import normalise_row
from fleetrl.data.synthetic import SYNTHETIC_TASKS, register_synthetic

__all__ = ["DataError", "MixtureDataset", "MixtureSampler", "PromptDataset", "PromptRecord", "SYNTHETIC_TASKS",
           "collate", "load_dataset", "normalise_row", "read_rows", "register_synthetic"]
