"""embcore: a software embedding accelerator for PyTorch.

TensorFlow's TPU embedding system (tables, features, an engine that looks up ids and applies a
sparse optimizer in place, checkpoints and serving) rebuilt for CPUs and GPUs. See README.md.
"""

from .base.version import __version__
from .checkpoint import load, save
from .config.exchange import ExchangeCompression
from .config.optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, LaProp, RowwiseAdagrad
from .config.spec import EmbeddingSpec
from .config.tables import DynamicVocabulary, FeatureConfig, TableConfig
from .engine import Embedding
from .layer import EmbeddingLayer
from .online import load_published, publish
from .planning.plan import ShardingPlan
from .planning.profile import LookupProfile, profile
from .serving.package import load_package, package_program
from .serving.quantize import QuantizedTable, quantize_table
from .serving.serve import serving_embedding_lookup

cpu_embedding_lookup = serving_embedding_lookup

__all__ = [
    "FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "DynamicVocabulary", "Embedding",
    "EmbeddingLayer", "EmbeddingSpec", "ExchangeCompression", "FeatureConfig", "LaProp",
    "LookupProfile", "QuantizedTable", "RowwiseAdagrad", "ShardingPlan", "TableConfig",
    "cpu_embedding_lookup", "load", "load_package", "load_published", "package_program",
    "profile", "publish", "quantize_table", "save", "serving_embedding_lookup",
    "__version__",
]
