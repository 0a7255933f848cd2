"""Each optimizer is declared once (config/optimizers.py ``OptimizerRecord``): every exported
optimizer has one record; its rule ids are the kernels' own constants (csrc/update.h, cpu.py,
triton_kernels.py); the kernel choice read from the records gives the answers the per-class
lists gave; the spec's and ``resolve_optimizer``'s names are the records'."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import embcore as ec
from embcore.config import optimizers as eo
from embcore.config.optimizers import Optimizer, record_of, records
from embcore.config.spec import OPTIMIZERS
from embcore.config.torch_optim import resolve_optimizer
from embcore.kernels import cpu, gpu, rules
from embcore.kernels.gpu import rows as triton_kernels
from embcore.kernels.rules import Rule
from embcore.ops import update

CSRC = cpu.CSRC / "update.h"
EXPORTED = {getattr(ec, name) for name in ec.__all__
            if inspect.isclass(getattr(ec, name)) and issubclass(getattr(ec, name), Optimizer)}
# The rule of each optimizer that has one (kernels/rules.py).
TRITON_NAMES = {"SGD": "SGD", "Adagrad": "ADAGRAD", "RowwiseAdagrad": "ROWWISE_ADAGRAD",
                "AdagradMomentum": "MOMENTUM", "Adam": "ADAM", "FTRL": "FTRL"}


def test_every_exported_optimizer_has_exactly_one_record():
    assert EXPORTED == {r.cls for r in records()}
    assert len(records()) == len(EXPORTED) == len({r.name for r in records()})
    for r in records():
        assert record_of(r.cls) is r and record_of(r.cls()) is r and r.cls._record is r
        assert r.name == r.cls.__name__ and getattr(ec, r.name) is r.cls
    aliases = [r.alias for r in records() if r.alias is not None]
    assert len(aliases) == len(set(aliases)) and all(a == a.lower() for a in aliases)
    with pytest.raises(TypeError, match="'SGD' is declared twice"):
        eo._declare()(type("SGD", (Optimizer,), {"__module__": __name__}))
    assert len(records()) == len(EXPORTED)


def test_records_name_real_hyper_parameters_and_slots():
    for r in records():
        names = {f.name for f in dataclasses.fields(r.cls)}
        assert all(rng.name in names for rng in r.ranges), r.name
        assert all(s.initial in names for s in r.slots if isinstance(s.initial, str)), r.name
        opt = r.cls()
        assert [s.name for s in opt.slots] == [s.name for s in r.slots]
        h, f1, f2 = r.triton_args(opt)
        assert len(h) <= 5 and all(isinstance(x, (int, float)) for x in h)
        assert isinstance(f1, bool) and isinstance(f2, bool)
        assert r.in_place is None or r.in_place in update._IN_PLACE
        # the fused CPU kernel and the in-place rules read one slot (the accumulators) or none
        assert rules.of(r.rule, rules.NATIVE) is None or [s.name for s in r.slots] in ([], ["accumulators"])
        assert r.in_place is None or [s.name for s in r.slots] in ([], ["accumulators"])


def test_a_subclass_has_no_record_of_its_own():
    """A user's subclass keeps its base's slots and checks but no kernel and no spec name."""
    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class Mine(ec.Adagrad):
        pass

    opt = Mine(initial_accumulator_value=0.5)
    assert record_of(opt) is None and opt.slots == ec.Adagrad(initial_accumulator_value=0.5).slots
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        Mine(initial_accumulator_value=-1.0)
    table = torch.zeros(3, 2)
    assert update.native_rule(opt, table) is None and not update.in_place_supported(opt, table)
    assert gpu.update_rule(opt) is None
    with pytest.raises(ValueError, match="Mine is not one of"):
        ec.EmbeddingSpec(ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=3, dim=2)), opt)


# -- the rule ids are the kernels' constants ----------------------------------------------------

def test_rules_are_numbered_once_in_kernels_rules():
    # every record names a rule of kernels/rules.py, or none
    assert {r.name: r.rule for r in records() if r.rule is not None} == TRITON_NAMES
    assert all(r.rule is None or r.rule in Rule.__members__ for r in records())
    # the C enum takes its values from the build's definitions, which rules.py writes
    enum = re.search(r"enum Rule : int \{([^}]*)\}", CSRC.read_text())
    assert enum, f"no 'enum Rule : int {{...}}' in {CSRC}"
    cpp = dict(re.findall(r"(k\w+)\s*=\s*(\w+)", enum.group(1)))
    assert cpp == {"kSGD": "EC_RULE_SGD", "kAdagrad": "EC_RULE_ADAGRAD",
                   "kRowwiseAdagrad": "EC_RULE_ROWWISE_ADAGRAD"}
    assert {f"-DEC_RULE_{r.name}={int(r)}" for r in Rule} <= set(cpu.DEFINES)
    assert cpu.update._RULES == {int(r): r.name for r in rules.NATIVE}
    assert (cpu.SGD, cpu.ADAGRAD, cpu.ROWWISE_ADAGRAD) == (
        Rule.SGD, Rule.ADAGRAD, Rule.ROWWISE_ADAGRAD)


def test_triton_rules_are_the_enum():
    def value(c):
        return getattr(c, "value", c)  # tl.constexpr where triton is installed, else an int

    assert {r.name: value(getattr(triton_kernels, r.name)) for r in Rule} == {
        r.name: int(r) for r in Rule}
    assert {Rule[r.rule] for r in records() if r.rule is not None} == set(rules.TRITON)
    assert rules.NATIVE < rules.TRITON and Rule.NONE not in rules.TRITON


# -- dispatch: the answers of the per-class lists the records replaced ---------------------------

TABLES = {"f32": torch.zeros(4, 3), "f16": torch.zeros(4, 3, dtype=torch.float16),
          "bf16": torch.zeros(4, 3, dtype=torch.bfloat16),
          "f64": torch.zeros(4, 3, dtype=torch.float64), "noncontig": torch.zeros(3, 4).t()}
_ = None
S, A, R = Rule.SGD, Rule.ADAGRAD, Rule.ROWWISE_ADAGRAD  # the fused CPU kernel's rules
# optimizer: (native_rule on TABLES, in_place_supported on TABLES, gpu.update_rule), as the code gave
# them before the records (ops/update.py _RULES and its type lists, kernels/gpu/launch.py's if-chain).
DISPATCH = [
    (ec.SGD(), (S, S, S, _, _), (1, 0, 0, 1, 1), (1, (), False, False)),
    (ec.SGD(clipvalue=1.0), (S, S, S, _, _), (0, 0, 0, 0, 0), (1, (), False, False)),
    (ec.SGD(gradient_multiplier=abs), (S, S, S, _, _), (0, 0, 0, 0, 0), (1, (), False, False)),
    (ec.Adagrad(), (A, A, A, _, _), (1, 0, 0, 1, 1), (2, (), False, False)),
    (ec.Adagrad(initial_accumulator_value=0.0), (A, A, A, _, _), (0, 0, 0, 0, 0),
     (2, (), False, False)),
    (ec.Adagrad(weight_decay_factor=0.1), (A, A, A, _, _), (0, 0, 0, 0, 0), (2, (), False, False)),
    (ec.RowwiseAdagrad(), (R, R, R, _, _), (1, 0, 0, 1, 1), (3, (), False, False)),
    (ec.RowwiseAdagrad(initial_accumulator_value=0.0), (R, R, R, _, _), (0, 0, 0, 0, 0),
     (3, (), False, False)),
    (ec.RowwiseAdagrad(clip_weight_min=-1.0), (R, R, R, _, _), (0, 0, 0, 0, 0),
     (3, (), False, False)),
    (ec.AdagradMomentum(), (_,) * 5, (0,) * 5, (4, (0.0, 1, 1e-10, -0.5), False, True)),
    (ec.AdagradMomentum(momentum=0.9, use_nesterov=True, exponent=4, beta2=0.5, epsilon=1e-3),
     (_,) * 5, (0,) * 5, (4, (0.9, 0.5, 0.001, -0.25), True, False)),
    (ec.Adam(), (_,) * 5, (0,) * 5,
     (5, (0.9, 0.09999999999999998, 0.999, 0.0010000000000000009, 1e-07), True, False)),
    (ec.Adam(lazy_adam=False), (_,) * 5, (0,) * 5, None),
    (ec.Adam(beta_1=0.5, beta_2=0.75, epsilon=1e-3, sum_inside_sqrt=False), (_,) * 5, (0,) * 5,
     (5, (0.5, 0.5, 0.75, 0.25, 0.001), False, False)),
    (ec.FTRL(), (_,) * 5, (0,) * 5, (6, (0.5, 0.0, 0.0, 0.0), False, False)),
    (ec.FTRL(learning_rate_power=-0.25, l1_regularization_strength=0.5,
             l2_regularization_strength=0.25, beta=0.125, multiply_linear_by_learning_rate=True),
     (_,) * 5, (0,) * 5, (6, (0.25, 0.5, 0.25, 0.125), True, False)),
    (ec.LaProp(), (_,) * 5, (0,) * 5, None),  # new: no kernel runs it
]


@pytest.mark.parametrize("opt, natives, in_place, triton", DISPATCH,
                         ids=[repr(case[0]) for case in DISPATCH])
def test_dispatch_reads_the_records_as_the_lists_did(opt, natives, in_place, triton):
    for (name, table), want_native, want_in_place in zip(TABLES.items(), natives, in_place):
        assert update.native_rule(opt, table) == want_native, name
        assert update.in_place_supported(opt, table) is bool(want_in_place), name
    got = gpu.update_rule(opt)
    assert got == triton
    if got is not None:
        assert all(type(x) is type(y) for x, y in zip(got[1], triton[1]))
        assert gpu.update_supported(opt, torch.zeros(4, 3), {
            s.name: torch.zeros(4, 1 if s.rowwise else 3) for s in opt.slots})


def test_every_record_is_covered_by_the_dispatch_table():
    assert {type(case[0]) for case in DISPATCH} == {r.cls for r in records()}


def test_native_sparse_update_refuses_a_rule_no_record_names():
    with pytest.raises(ValueError, match=r"rule 7 is none of SGD, ADAGRAD, ROWWISE_ADAGRAD"):
        cpu.sparse_update(7, torch.zeros(2, 2), None, torch.tensor([0]), cpu.Hyper(0.1),
                             [torch.zeros(1, 2)])


# -- names: the spec's and resolve_optimizer's ---------------------------------------------------

@pytest.mark.parametrize("record", records(), ids=lambda r: r.name)
def test_names_round_trip(record):
    assert OPTIMIZERS[record.name] is record.cls
    f = ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=5, dim=2, name="t"))
    d = json.loads(json.dumps(ec.EmbeddingSpec(f, record.cls()).to_dict()))
    assert d["optimizer"]["class"] == record.name
    assert ec.EmbeddingSpec.from_dict(d).optimizer == record.cls()
    if record.alias is not None:
        assert resolve_optimizer(record.alias) == record.cls()
        assert resolve_optimizer(record.alias.upper()) == record.cls()


def test_errors_list_the_records_names():
    names = [r.alias for r in records() if r.alias is not None]
    with pytest.raises(ValueError) as e:
        resolve_optimizer("nope")
    assert all(repr(a) in str(e.value) for a in names)
    with pytest.raises(TypeError) as e:
        resolve_optimizer(42)
    assert all(repr(a) in str(e.value) for a in names)
    with pytest.raises(ValueError) as e:
        resolve_optimizer(torch.optim.RMSprop)
    assert all(f"ec.{r.name}" in str(e.value) for r in records())
    with pytest.raises(TypeError) as e:
        Optimizer()
    assert all(f"ec.{r.name}" in str(e.value) for r in records())
    d = ec.EmbeddingSpec(ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=5, dim=2)),
                         ec.SGD()).to_dict()
    d["optimizer"]["class"] = "Lion"
    with pytest.raises(ValueError) as e:
        ec.EmbeddingSpec.from_dict(d)
    assert all(repr(r.name) in str(e.value) for r in records())
