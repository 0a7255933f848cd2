"""After training: the tutorial's restore / export / serve steps, each printed and checked.

1. restore the checkpoint into a fresh model on CPU, without optimizer slots;
2. restore only the embedding tables into another fresh model (a partial restore) and show its
   lookups equal the trained ones;
3. export the whole ranking model with ``torch.export`` (tables through ``layer.for_serving()``),
   save it as ``serving.pt2``, load it back with ``torch.export.load`` (no embcore needed to run
   it) and predict user 30's rating of movie 100;
4. look up a subset of the tables with a ``serving_config``.

A ``--raw-ids`` run serves the same way: its tables' maps (raw id -> row) travel in the checkpoint
and in ``layer.for_serving()``, and every model here, the exported one included, is fed raw ids
(``data.raw_ids`` of the MovieLens ids); an id not resident looks up zeros. Only step 1 differs:
dynamic tables cannot be plain parameters, so the restored model keeps an engine optimizer whose
slots stay at their initial values (``slots=False`` reads the tables and their maps only).

Compact tables (``--dtype float16`` / ``bfloat16``) serve the same way: the checkpoint records the
rows' dtype (``ModelConfig.dtype`` in dense.pt, the manifest's tables), every restored model and
the exported one hold the rows in it (step 1 checks), and lookups widen them to float32.

Run on its own against a finished run:  python examples/movielens/serve.py --out runs/movielens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import embcore as ec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import MovieLens, raw_ids  # noqa: E402
from model import (  # noqa: E402
    DTYPES,
    MOVIE_TABLE,
    USER_TABLE,
    RankingModel,
    ServingModel,
    as_model_config,
)

USER, MOVIE = 30, 100  # the tutorial's serving example


def restore_for_serving(ckpt: Path, *, dense: bool = True) -> RankingModel:
    """A fresh CPU model holding the checkpoint's tables (no slots) and, with ``dense``, its MLP.

    Built with ``embedding_optimizer=None``, its tables are plain parameters with no optimizer
    slots; ``ec.load(..., slots=False)`` reads only the tables' parameters (and a raw-id run's
    maps: its dynamic tables need an engine optimizer, whose slots are left unread).
    """
    state = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=True)
    config = as_model_config(state["model_config"])
    model = RankingModel(config, ec.Adagrad(learning_rate=0.1) if config.raw_ids else None,
                         device="cpu")
    ec.load(ckpt / "embedding", model.embedding, slots=False)
    if dense:
        model.head.load_state_dict(state["head"])
    return model.eval()


def export_serving_model(model: RankingModel, path: Path) -> torch.export.ExportedProgram:
    """Exports ``ServingModel(model)`` with a dynamic batch size and saves it to ``path``."""
    serving = ServingModel(model).eval()
    batch = torch.export.Dim("batch")  # any batch size; traced with 2 examples
    example = {"user_id": torch.tensor([1, 2]), "movie_id": torch.tensor([1, 2])}
    program = torch.export.export(serving, args=(), kwargs=example,
                                  dynamic_shapes={"user_id": {0: batch}, "movie_id": {0: batch}})
    torch.export.save(program, path)
    return program


def _resident(model: RankingModel, table: str, ids: torch.Tensor) -> bool:
    """Whether every raw id of ``ids`` holds a row of the dynamic ``table``."""
    return bool(torch.isin(ids, model.embedding.engine.vocabulary(table)[0]).all())


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _ids(users: list[int], movies: list[int], raw: bool = False) -> dict[str, torch.Tensor]:
    """The model's input for MovieLens ids (hashed into raw ids for a ``--raw-ids`` model)."""
    ids = {"user_id": torch.tensor(users), "movie_id": torch.tensor(movies)}
    return {k: raw_ids(v) for k, v in ids.items()} if raw else ids


@torch.no_grad()
def serving_flow(trained: RankingModel, ckpt: Path, out: Path,
                 data: MovieLens | None = None) -> dict[str, Any]:
    """Runs steps 1-4 against the trained model; returns what they measured.

    Raises:
        RuntimeError: a restored or exported model disagrees with the trained one.
    """
    trained.eval()
    device = next(trained.head.parameters()).device
    raw = trained.config.raw_ids
    probe = _ids([USER, 1, 2, 3, 943], [MOVIE, 50, 181, 1, 1682], raw)  # (user, movie) pairs
    expected = trained({k: v.to(device) for k, v in probe.items()}).cpu()  # (5,)

    print(f"[1/4] restore {ckpt} into a fresh CPU model " + (
        "(raw ids: the tables and their maps; an engine optimizer with unread slots)" if raw
        else "without optimizer slots"))
    cpu_model = restore_for_serving(ckpt)
    slots = [k for k in cpu_model.state_dict() if not k.endswith(("parameters", "step"))
             and k.startswith("embedding.") and "/vocabulary/" not in k]
    got = cpu_model(probe)
    diff = (got - expected).abs().max().item()
    rows = {k.split("/")[0]: v.dtype for k, v in cpu_model.embedding.state_dict().items()
            if k.endswith("/parameters")}
    dtype = str(DTYPES[cpu_model.config.dtype]).replace("torch.", "")
    print(f"      embedding state: {sorted(cpu_model.embedding.state_dict())} "
          f"({'unread slots' if raw else 'slots'}: {slots}; rows {dtype}); "
          f"predictions equal the trained model's: max |diff| = {diff:.2e}")
    _check(diff < 1e-5, f"restored model differs from the trained one by {diff}")
    _check(set(rows.values()) == {DTYPES[cpu_model.config.dtype]},
           f"the restored tables hold {rows}, not the trained {dtype} rows")

    print(f"[2/4] partial restore: only tables {[USER_TABLE, MOVIE_TABLE]} into a fresh model")
    partial = RankingModel(cpu_model.config, ec.Adagrad(learning_rate=0.1), device="cpu").eval()
    ec.load(ckpt / "embedding", partial.embedding, tables=[USER_TABLE, MOVIE_TABLE], slots=False)
    trained_acts = trained.embedding({k: v.to(device) for k, v in probe.items()})
    partial_acts = partial.embedding(probe)
    lookups_equal = all(torch.equal(partial_acts[k], trained_acts[k].cpu()) for k in probe)
    print(f"      lookups equal the trained ones: {lookups_equal} (the MLP stays freshly "
          f"initialized: ready to train a new head on the restored tables)")
    _check(lookups_equal, "partially restored lookups differ from the trained ones")

    path = out / "serving.pt2"
    print(f"[3/4] export the ranking model with torch.export to {path}")
    export_serving_model(cpu_model, path)
    served = torch.export.load(path).module()  # plain torch: no embcore object inside
    prediction = served(**_ids([USER], [MOVIE], raw)).item()
    reference = expected[0].item()
    title = (data.titles.get(MOVIE) if data is not None else None) or f"movie {MOVIE}"
    resident = ""
    if raw:  # an id not resident (never admitted, or evicted) looks up zeros
        resident = "".join(f"; {what} resident: {_resident(cpu_model, table, probe[key][:1])}"
                           for what, table, key in (("user", USER_TABLE, "user_id"),
                                                    ("movie", MOVIE_TABLE, "movie_id")))
    print(f"      exported model: user {USER} rates {title!r} {prediction:.4f} "
          f"(trained model: {reference:.4f}{resident})")
    _check(abs(prediction - reference) < 1e-5, "the exported model disagrees with the trained one")
    batch_diff = (served(**probe) - expected).abs().max().item()
    _check(batch_diff < 1e-5, f"the exported model differs on a batch by {batch_diff}")

    print("[4/4] serving_config: look up only the movies table")
    movies_only = {"movie_id": cpu_model.feature_config["movie_id"]}
    acts = cpu_model.embedding({"movie_id": probe["movie_id"]}, serving_config=movies_only)
    full = cpu_model.embedding(probe)
    subset_equal = list(acts) == ["movie_id"] and torch.equal(acts["movie_id"], full["movie_id"])
    movie_server = cpu_model.embedding.for_serving(serving_config=movies_only)
    print(f"      layer(..., serving_config) gives {sorted(acts)}, equal to the full lookup: "
          f"{subset_equal}; for_serving(serving_config) holds only "
          f"{sorted(n for n, _ in movie_server.named_buffers())}")
    _check(subset_equal, "the serving_config lookup differs from the full lookup")
    full_config_prediction = cpu_model(probe, serving_config=cpu_model.feature_config)
    _check(torch.equal(full_config_prediction, got),
           "a serving_config of every feature changed the prediction")

    return {"serving_prediction": prediction, "trained_prediction": reference,
            "table_dtype": dtype, "restore_max_diff": diff, "partial_restore_equal": lookups_equal,
            "serving_config_equal": subset_equal}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Restore, export and serve a trained run.")
    p.add_argument("--out", type=Path, default=Path("runs/movielens"),
                   help="the --out directory of a train.py run")
    args = p.parse_args(argv)
    from train import latest_checkpoint
    ckpt = latest_checkpoint(args.out / "checkpoints")
    if ckpt is None:
        raise SystemExit(f"no checkpoint under {args.out / 'checkpoints'}; run train.py first")
    return serving_flow(restore_for_serving(ckpt), ckpt, args.out)


if __name__ == "__main__":
    main()
