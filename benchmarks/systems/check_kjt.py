"""embcore with TorchRec's real KeyedJaggedTensor (torchrec is not an embcore dependency: this runs
in the peers' environment, with embcore from the checkout on the path):

    PYTHONPATH=. .venv-peers/bin/python benchmarks/systems/check_kjt.py

A KJT of two keys (with and without weights) is looked up, trained and served through embcore and
compared with the same batch given as jagged tensors; prints one line and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embcore as ec


def main() -> int:
    torch.manual_seed(0)
    items = ec.TableConfig(vocabulary_size=50, dim=8, combiner="mean", name="items")
    users = ec.TableConfig(vocabulary_size=20, dim=8, combiner="sum", name="users")
    fc = {"history": ec.FeatureConfig(table=items), "user": ec.FeatureConfig(table=users)}
    lengths = torch.tensor([3, 0, 2, 1, 1, 1])
    values = torch.tensor([4, 9, 9, 1, 2, 7, 3, 5])
    weights = torch.rand(8)
    checks = []
    for w in (None, weights):
        kjt = KeyedJaggedTensor(keys=["history", "user"], values=values, lengths=lengths,
                                weights=w)
        jt = kjt.to_dict()  # {key: JaggedTensor}
        ids = {k: torch.nested.nested_tensor_from_jagged(v.values(), v.offsets())
               for k, v in jt.items()}
        ws = None if w is None else {k: torch.nested.nested_tensor_from_jagged(
            v.weights(), v.offsets()) for k, v in jt.items()}
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1))
        want, got = emb.lookup(ids, ws), emb.lookup(kjt)
        served = ec.serving_embedding_lookup(kjt, None, emb.embedding_tables, fc)
        checks += [torch.allclose(got[k], want[k]) and torch.allclose(served[k], want[k])
                   for k in fc]
        emb.enqueue(kjt)
        acts = emb.dequeue()
        emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})
        checks.append(emb.step == 1)
    ok = all(checks)
    print(f"torchrec KeyedJaggedTensor through embcore: {'equal' if ok else 'MISMATCH'} to the "
          f"same batch as jagged tensors ({len(checks)} checks, with and without weights)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
