"""embcore: a software embedding accelerator for PyTorch.

TensorFlow's TPU embedding system (tables, features, an engine that looks up ids and applies a
sparse optimizer in place, checkpoints and serving) rebuilt for CPUs and GPUs. See README.md.
"""

__version__ = "0.1.0"

from .checkpoint import load, save
from .config import DynamicVocabulary, FeatureConfig, TableConfig
from .engine import Embedding
from .layer import EmbeddingLayer
from .optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, RowwiseAdagrad
from .plan import ShardingPlan
from .profile import LookupProfile, profile
from .quantize import QuantizedTable, quantize_table
from .serving import serving_embedding_lookup
from .spec import EmbeddingSpec

cpu_embedding_lookup = serving_embedding_lookup

__all__ = [
    "FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "DynamicVocabulary", "Embedding",
    "EmbeddingLayer", "EmbeddingSpec", "FeatureConfig", "LookupProfile", "QuantizedTable",
    "RowwiseAdagrad", "ShardingPlan", "TableConfig", "cpu_embedding_lookup", "load", "profile",
    "quantize_table", "save", "serving_embedding_lookup", "__version__",
]
