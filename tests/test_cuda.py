"""The engine on a CUDA device equals the CPU engine (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import embcore as ec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def build(device, opt):
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=1000, dim=16, combiner="mean", name="t")
    u = ec.TableConfig(vocabulary_size=500, dim=16, combiner="sum", name="u")
    fc = {"a": ec.FeatureConfig(table=t), "b": ec.FeatureConfig(table=u),
          "c": ec.FeatureConfig(table=t, max_sequence_length=4)}
    return ec.Embedding(fc, opt, device=device)


def batch(device, step):
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(0, 5, (32,), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    jag = torch.nested.nested_tensor_from_jagged(torch.randint(0, 500, (int(offs[-1]),), generator=g), offs)
    out = {"a": torch.randint(0, 1000, (32,), generator=g), "b": jag,
           "c": torch.randint(0, 1000, (32, 6), generator=g)}
    return {k: v.to(device) for k, v in out.items()}


@pytest.mark.parametrize("opt", [lambda: ec.Adagrad(learning_rate=0.1),
                                 lambda: ec.RowwiseAdagrad(learning_rate=0.1),
                                 lambda: ec.Adam(learning_rate=0.01, lazy_adam=False),
                                 lambda: ec.FTRL(learning_rate=0.1)])
def test_cuda_engine_equals_cpu(opt):
    cpu, gpu = build("cpu", opt()), build("cuda", opt())
    for step in range(3):
        outs = []
        for emb, dev in ((cpu, "cpu"), (gpu, "cuda")):
            emb.enqueue(batch(dev, step))
            acts = emb.dequeue()
            for a in acts.values():
                assert a.device.type == dev
            emb.apply_gradients({k: (a.detach() * 0.5 + 1).to(dev) for k, a in acts.items()})
            outs.append(acts)
        for k in outs[0]:
            torch.testing.assert_close(outs[1][k].cpu(), outs[0][k], rtol=1e-5, atol=1e-5)
    for k, v in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[k].cpu(), v, rtol=1e-5, atol=1e-5)


def test_cuda_layer_and_serving():
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=100, dim=8, name="t")
    layer = ec.EmbeddingLayer({"x": ec.FeatureConfig(table=t)}, "adagrad", device="cuda")
    out = layer({"x": torch.tensor([1, 2, 3], device="cuda")})["x"]
    out.sum().backward()
    served = layer.for_serving()({"x": torch.tensor([1, 2, 3], device="cuda")})["x"]
    assert served.device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dynamic", [False, True])
def test_cuda_compact_rows_round_as_the_cpu(dtype, dynamic):
    """float16 / bfloat16 tables on the GPU (Triton's lookup and update, the rows' keys in the
    kernel) and on the CPU (the fused kernels): SGD on dyadic gradients (exact in float32 in any
    order), so the stochastically rounded rows agree bit for bit."""
    out = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        mk = lambda n, name: ec.TableConfig(  # noqa: E731
            vocabulary_size=n, dim=16, dtype=dtype, name=name,
            dynamic=ec.DynamicVocabulary() if dynamic and name == "u" else None)
        t, u = mk(1000, "t"), mk(500, "u")
        emb = ec.Embedding({"a": ec.FeatureConfig(table=t), "b": ec.FeatureConfig(table=u)},
                           ec.SGD(learning_rate=0.125), device=device)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = {"a": torch.randint(0, 1000, (64,), generator=g),
                   "b": torch.randint(0, 500, (64,), generator=g) * (7919 if dynamic else 1)}
            grads = {k: torch.randint(-64, 65, (64, 16), generator=g).float() / 64 for k in ids}
            emb.enqueue({k: v.to(device) for k, v in ids.items()})
            acts = emb.dequeue()
            assert all(a.dtype == torch.float32 for a in acts.values())
            emb.apply_gradients({k: v.to(device) for k, v in grads.items()})
        out.append({k: v.cpu() for k, v in emb.state_dict().items() if k.endswith("parameters")})
    for k in out[0]:
        assert out[1][k].dtype == dtype
        assert torch.equal(out[0][k], out[1][k]), k
