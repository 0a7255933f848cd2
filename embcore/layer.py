"""The layer (``ec.EmbeddingLayer``): the engine as a ``torch.nn.Module``.

In training (module in train mode, grad enabled) the forward looks up one batch as an engine
``training_step`` inside an autograd Function whose backward hands the activation gradients to
that step, so ``loss.backward()`` applies the engine's optimizer to the touched rows. Each forward
carries its own step (docs/semantics.md section 6): a forward never backpropagated applies nothing
and blocks nothing; two forwards then one backward over both apply both. In eval mode or under
``torch.no_grad()`` the forward is a plain lookup. With ``optimizer=None`` the tables are ordinary
``nn.Parameter``s and any torch optimizer trains them (TF's TPUEmbeddingV0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from .base.nest import Structure
from .config.dtypes import SCALED, SCALES
from .config.spec import EmbeddingSpec, from_spec
from .config.tables import TableConfig
from .config.torch_optim import resolve_optimizer
from .engine import Embedding, EmbeddingTables
from .inputs.features import is_feature
from .numerics.rounding import clamp_fix, narrowed_for_load, widen
from .serving.serve import ServingModule, serving_embedding_lookup

_REPR_TABLES = 12  # print(layer) lists this many tables, then counts the others


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


class _EngineStep(torch.autograd.Function):
    """Forward: a training step's lookup. Backward: that step's apply, with the gradients."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, engine: Embedding, structure: Structure,
                features: Any, weights: Any) -> tuple[torch.Tensor, ...]:
        step = engine.training_step(features, weights)
        flat = tuple(structure.flatten(step.activations, "activations"))
        # ctx must not reach the outputs: output -> grad_fn -> ctx -> step -> output would be a
        # cycle through autograd's C++ graph, which Python's gc cannot see or break (every
        # step's activations and batch were kept for good: ~9 MB a step on the DLRM benchmark)
        step.activations = None
        ctx.step, ctx.structure = step, structure
        ctx.set_materialize_grads(False)  # unused activations come back as None: zero gradient
        return flat

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.step.apply(ctx.structure.unflatten(grads), warn_on_none=False)
        return None, None, None, None, None


class EmbeddingLayer(torch.nn.Module):
    """Embedding tables trained inside the engine, as a module of your model.

    Args:
        feature_config: a FeatureConfig or nested dict / list / tuple of them.
        optimizer: an embcore optimizer; "sgd" / "adagrad" / "adam" / "ftrl"; a ``torch.optim``
            class among SGD, Adagrad, Adam (the class, ``functools.partial(cls, lr=...)`` or
            ``(cls, {"lr": ...})``), translated to the embcore optimizer with the same math; or
            None: the tables are ``nn.Parameter``s trained by your own torch optimizer.

    The keyword-only args (pipeline_execution, sharding, process_group, device, timeout,
    memory_budget, offload_dir, profile, exchange_compression, host_checks) are those of
    ``ec.Embedding`` (``layer.engine.check()`` reads the checks a GPU made on the device).

    A training forward's ``backward()`` applies its batch's update (each forward carries its own
    step; a forward never backpropagated changes nothing). The batch size may vary between
    training forwards unless ``build`` or ``output_shape`` fixed it. Tables live on ``device``;
    ``layer.to(device)`` moves them (with one process), ``layer.to(dtype)`` leaves their dtype
    (``TableConfig.dtype``).

    ``layer.engine`` is the ``ec.Embedding`` underneath: its plan (``layer.engine.plan``), its
    state (``ec.save(path, layer)`` saves it) and every engine method; a raw-id table's resident
    ids are also the layer's own ``vocabulary`` and ``whole_vocabulary``.

    Example:
        >>> import torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=100, dim=8, name="items")
        >>> layer = ec.EmbeddingLayer({"item": ec.FeatureConfig(table=t)}, ec.Adagrad(0.1))
        >>> out = layer({"item": torch.tensor([1, 5, 7])})["item"]   # (3, 8)
        >>> out.square().sum().backward()   # rows 1, 5 and 7 are updated by Adagrad
    """

    def __init__(self, feature_config: Any, optimizer: Any = None, *,
                 pipeline_execution: bool = False, sharding: Any = None,
                 process_group: Any = None, device: torch.device | str | None = None,
                 timeout: float | timedelta | None = None,
                 memory_budget: int | str | None = None,
                 offload_dir: Any = None, profile: Any = None,
                 exchange_compression: Any = None, host_checks: bool = False) -> None:
        super().__init__()
        self.feature_config = feature_config
        opt = resolve_optimizer(optimizer) if optimizer is not None else None
        self.engine = Embedding(feature_config, opt, pipeline_execution=pipeline_execution,
                                sharding=sharding, process_group=process_group, device=device,
                                timeout=timeout, memory_budget=memory_budget,
                                offload_dir=offload_dir, profile=profile,
                                exchange_compression=exchange_compression,
                                host_checks=host_checks)
        self._parameters_mode = optimizer is None
        dynamic = sorted(n for t, n in self.engine.table_names().items() if t.dynamic is not None)
        if self._parameters_mode and dynamic:
            raise ValueError(f"tables {dynamic} are dynamic (raw ids): their rows are admitted and "
                             f"evicted by the engine's optimizer step, so they cannot be plain "
                             f"nn.Parameters; pass an optimizer (e.g. 'adagrad')")
        scaled = sorted(n for t, n in self.engine.table_names().items() if t.dtype in SCALED)
        if self._parameters_mode and scaled:
            raise ValueError(f"tables {scaled} have 8-bit rows, each with a scale that the "
                             f"engine's update sets, so they cannot be plain nn.Parameters; "
                             f"pass an optimizer (e.g. 'adagrad'), or give them dtype="
                             f"torch.float16, torch.bfloat16 or torch.float32")
        self._anchor = torch.zeros((), requires_grad=True)  # gives the Function a grad path
        self._structure = Structure(self.engine.feature_config, is_feature)
        self.engine.build()  # now, not inside the first (maybe compiled) forward
        if self.tables_are_parameters:  # the engine's seeded initial values, as parameters
            for t, name in self.engine.table_names().items():
                values = self.engine.embedding_tables[t].detach().clone()
                self.register_parameter(f"{name}/parameters", torch.nn.Parameter(values))

    def extra_repr(self) -> str:
        """``print(layer)``: its features, tables (size, combiner, strategy, the features that
        read each) and optimizer, and the plan's summary; ``print(layer.engine.plan)`` has the
        whole plan. Past ``_REPR_TABLES`` tables, a count of the others."""
        m, plan = self.engine.manifest(), self.engine.plan
        tables = m["tables"]
        readers: dict[str, list[str]] = {}
        for f in m["features"]:
            readers.setdefault(f["table"], []).append(f["name"])
        optimizers = {t["optimizer"] for t in tables.values()}
        trained = ("tables as nn.Parameters (optimizer=None)" if self.tables_are_parameters
                   else f"optimizer={next(iter(optimizers))}" if len(optimizers) == 1
                   else "an optimizer per table")
        mib = " ".join(f"{b / 2**20:.2f}" for b in plan.bytes_per_rank())
        header = (f"{_count(len(m['features']), 'feature')}, {_count(len(tables), 'table')}, "
                  f"{trained}, step={m['step']}, device={self.engine.device}")
        summary = (f"plan: world_size={plan.world_size}, "
                   f"{_count(len(plan.physical), 'physical table')}"
                   + (f", backend: {plan.backend}" if plan.backend else "")
                   + f", MiB per rank (parameters + slots): {mib}")
        lines = [header, summary]
        for t in plan.tables[:_REPR_TABLES]:
            d = tables[t.name]
            kind = [d["combiner"], d["dtype"] if d["dtype"] != "float32" else "",
                    "dynamic (raw ids)" if d["dynamic"] is not None else "",
                    "slow tier" if plan.physical[t.physical].offloaded else "",
                    f"optimizer={d['optimizer']}" if len(optimizers) > 1 else "",
                    f"sharding {t.strategy}", f"features {', '.join(readers.get(t.name, []))}"]
            lines.append(f"table {t.name}: {t.rows} x {t.dim}, "
                         + ", ".join(k for k in kind if k))
        if len(plan.tables) > _REPR_TABLES:
            lines.append(f"... and {len(plan.tables) - _REPR_TABLES} more tables "
                         f"(print(layer.engine.plan))")
        return "\n".join(lines)

    @property
    def tables_are_parameters(self) -> bool:
        """True with ``optimizer=None`` (TF's TPUEmbeddingV0): the tables are this module's
        ``nn.Parameter``s, trained by the user's torch optimizer; the engine has no optimizer."""
        return self._parameters_mode

    @property
    def embedding_tables(self) -> EmbeddingTables:
        """``{TableConfig: (N, D)}`` — the parameters (V0 mode) or the engine's tables; also
        read by a table's name (``layer.embedding_tables["users"]``)."""
        if self.tables_are_parameters:
            params = dict(self.named_parameters(recurse=False))
            names = self.engine.table_names()
            return EmbeddingTables({t: params[f"{n}/parameters"] for t, n in names.items()},
                                   names)
        return self.engine.embedding_tables

    def vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A raw-id table's resident ids and their rows: ``ec.Embedding.vocabulary`` of
        ``layer.engine`` (``table``: its ``TableConfig`` or name)."""
        return self.engine.vocabulary(table)

    def whole_vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A raw-id table's resident ids over all processes and their rows of the whole table:
        ``ec.Embedding.whole_vocabulary`` of ``layer.engine`` (a collective when sharded)."""
        return self.engine.whole_vocabulary(table)

    def forward(self, features: Any, weights: Any = None, serving_config: Any = None) -> Any:
        """Activations mirroring feature_config (or ``serving_config``, a subset of it)."""
        template = serving_config if serving_config is not None else self.feature_config
        if self.tables_are_parameters:
            return serving_embedding_lookup(features, weights, self.embedding_tables, template)
        if serving_config is not None or not (self.training and torch.is_grad_enabled()):
            return self.engine.lookup(features, weights, serving_config=serving_config)
        flat = _EngineStep.apply(self._anchor, self.engine, self._structure, features, weights)
        return self._structure.unflatten(flat)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any,
               **kwargs: Any) -> EmbeddingLayer:
        """``.to()`` / ``.cuda()`` / ``.cpu()`` also move the engine's tables and slots (the
        target device is read off ``fn`` applied to a probe; dtype conversions leave them)."""
        out = super()._apply(fn, *args, **kwargs)
        if not self.tables_are_parameters:
            target = fn(torch.empty(0, device=self.engine.device)).device
            if target != self.engine.device:
                self.engine.to(target)
        return out

    @classmethod
    def from_spec(cls, spec: EmbeddingSpec, **kwargs: Any) -> EmbeddingLayer:
        """The layer that ``spec`` describes (config/spec.py's ``from_spec``); ``kwargs``: the
        arguments a spec does not hold (``process_group``, ``device``, ``timeout``, ...)."""
        return from_spec(cls, spec, **kwargs)

    def for_serving(self, serving_config: Any = None, *, quantize: Any = None
                    ) -> torch.nn.Module:
        """A module without optimizer slots whose forward is plain torch ops.

        It holds a snapshot of the tables (of ``serving_config``'s features, default all) and
        exports with dense ids, sparse COO ids and jagged ids given as ``(values, offsets)``
        pairs (torch.export cannot take nested tensors as inputs). ``module.export(features)``
        gives a program that serves batches of any size and any number of ids; a plain
        ``torch.export.export(module, args)`` fixes every size to the example's unless given
        ``dynamic_shapes=module.dynamic_shapes(*args)`` (then, traced from two jagged bags or
        more, it serves two bags or more). A dynamic table travels with its map, searched by
        sorted ids. Tables are buffers named after them (``module.buffer_name(table)``).

        Args:
            serving_config: the features to serve (a subset of the layer's, or new features on
                its tables); None: all.
            quantize: how the tables are held (docs/semantics.md section 12): None (as
                trained), ``"int8"`` (row-wise: uint8 codes and a float32 scale and bias per
                row, about a quarter of float32's bytes), ``"fp16"`` (half), or a mapping from
                table names to None / ``"int8"`` / ``"fp16"`` (tables left out stay as
                trained). Lookups dequantize the rows they read; activations are float32.

        Raises:
            ValueError: an unknown precision or table name in ``quantize``, or a table int8 /
                fp16 cannot hold (NaN / inf, values beyond fp16).

        Example:
            >>> import torch, embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=100, dim=8, name="items")
            >>> layer = ec.EmbeddingLayer({"item": ec.FeatureConfig(table=t)}, "adagrad")
            >>> served = layer.for_serving(quantize="int8")
            >>> served.items.dtype, served.table_bytes()   # 100 x (8 codes + scale + bias)
            (torch.uint8, {'items': 1600})
            >>> served({"item": torch.tensor([1, 5])})["item"].dtype
            torch.float32
            >>> pair = (torch.tensor([1, 5, 7]), torch.tensor([0, 1, 3]))   # 2 bags, 3 ids
            >>> program = served.export({"item": pair})
            >>> pairs = {"item": (torch.arange(17), torch.tensor([0, 17]))}   # 17 ids, 1 bag
            >>> torch.allclose(program.module()(pairs)["item"], served(pairs)["item"])
            True
        """
        template = serving_config if serving_config is not None else self.feature_config
        names = self.engine.table_names()
        vocabularies = {t: self.engine.whole_vocabulary(t) for t in names
                        if t.dynamic is not None}  # (collectives when sharded)
        tables: Mapping[TableConfig, torch.Tensor] = self.embedding_tables
        scaled = [t for t in names if t.dtype in SCALED]
        if scaled:  # 8-bit rows served widened: code * scale (float32)
            state = self.engine.state_dict()
            tables = {t: widen(v, _whole(state[f"{names[t]}/{SCALES}"])) if t in scaled
                      else v for t, v in tables.items()}
        return ServingModule(template, tables, names, vocabularies, quantize=quantize)

    # state_dict / load_state_dict: the engine's flat keys under this module's prefix.
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        if self.tables_are_parameters:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        for k, v in self.engine.state_dict().items():
            destination[prefix + k] = v if keep_vars else v.detach()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        own = (dict(self.named_parameters(recurse=False)) if self.tables_are_parameters
               else self.engine.state_dict())
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        try:  # a 16-bit table's rows given wider: narrowed as ec.load narrows them
            values = {k: narrowed_for_load(v, own[k].dtype, k, "load_state_dict",
                                           "the state_dict", False, clamp_fix(own[k].dtype))
                      if k.endswith("/parameters") else v
                      for k, v in mine.items() if k in own}
        except ValueError as e:
            error_msgs.append(str(e))
            return  # nothing loaded: torch raises with every message
        if self.tables_are_parameters:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
            return
        unexpected_keys += [prefix + k for k in mine if k not in own]
        missing_keys += [prefix + k for k in own if k not in mine]
        try:
            self.engine.load_state_dict(values, strict=False)
        except (KeyError, ValueError) as e:
            error_msgs.append(str(e))



def engine_of(obj: Any, call: str) -> Embedding:
    """The engine that ``obj`` holds: an ``ec.Embedding`` itself, or an ``ec.EmbeddingLayer``'s
    (``layer.engine``). Every call that takes either (``ec.save``, ``ec.load``, ``ec.publish``)
    finds the engine here.

    Args:
        obj: what the user passed.
        call: the call, for the error (``"ec.save"``).

    Raises:
        TypeError: ``obj`` is neither, naming ``call`` and its type; for a TorchRec module of
            embcore (``embcore.torchrec``), naming the layer to pass instead.
    """
    if isinstance(obj, EmbeddingLayer):
        return obj.engine
    if isinstance(obj, Embedding):
        return obj
    fix = "pass the ec.Embedding or the ec.EmbeddingLayer that holds the tables"
    for name in ("embedding_bags", "embeddings"):  # embcore.torchrec's modules hold a layer
        if isinstance(getattr(obj, name, None), EmbeddingLayer):
            fix = f"pass its layer, {type(obj).__name__}.{name} (an ec.EmbeddingLayer)"
    raise TypeError(f"{call}: obj must be an ec.Embedding or ec.EmbeddingLayer, got "
                    f"{type(obj).__name__}; {fix}")


def _whole(value: Any) -> torch.Tensor:
    """A state_dict entry as one tensor (a sharded engine's checkpoint shard gathered)."""
    full = getattr(value, "full_tensor", None)
    return full() if full is not None else value
