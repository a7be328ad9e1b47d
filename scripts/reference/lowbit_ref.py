"""torchao's AdamW8bit / AdamW4bit as the oracle of memtrain's low-bit AdamW (optim/lowbit_adamw.h).

Writes OUT/lowbit.safetensors:
  map{8,4}_{m,v}                 torchao's quantization maps (exp_avg's signed, exp_avg_sq's)
  x, q{8,4}_{m,v}_{codes,absmax}   a tensor with zero, tiny and tied blocks quantized by torchao's own copy_
  init/<p>, bank/<k>/<p>         the parameters and a bank of 8 gradient sets
  b{8,4}/step1/<p>, b{8,4}/step200/<p>  the parameters after 1 and 200 steps, and the state of the quantized
                                 ones (<p>.m_codes, .m_absmax, .v_codes, .v_absmax) and of the others (.m, .v)
The gradient of step t (from 0) is bank[t % 8] + 0.5 p: computed with the same fp32 ATen ops on both sides.
torchao runs uncompiled (TORCHDYNAMO_DISABLE=1): its compiled CPU step differs from its eager one by an ulp.

usage: lowbit_ref.py OUT_DIR
"""
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"
# scripts/setup.sh keeps torchao beside the venv (not in it: peft would import it): <cache>/torchao0.18.0.
sys.path.insert(0, os.environ.get("MEMTRAIN_TORCHAO", os.path.join(os.path.dirname(sys.prefix), "torchao0.18.0")))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torchao.optim import AdamW4bit, AdamW8bit  # noqa: E402
from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
# quantized at both block sizes: 8192, 12288; fp32 state: 10 (small), 4900 (not whole blocks)
SHAPES = {"w1": (64, 128), "w2": (48, 256), "bias": (10,), "odd": (70, 70)}
STEPS = 200


def state_of(opt, p):
    s = opt.state[p]
    out = {}
    for key, short in (("exp_avg", "m"), ("exp_avg_sq", "v")):
        t = s[key]
        if isinstance(t, (OptimState8bit, OptimState4bit)):
            out[f".{short}_codes"] = t.codes.reshape(-1).clone()
            out[f".{short}_absmax"] = t.scale.reshape(-1).clone()
        else:
            out[f".{short}"] = t.reshape(-1).clone()
    return out


def trajectory(cls, tag, out):
    g = torch.Generator().manual_seed(7)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for n, s in SHAPES.items()}
    bank = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(8)]
    for n, p in params.items():
        out[f"init/{n}"] = p.detach().clone()
    for k, b in enumerate(bank):
        for n, t in b.items():
            out[f"bank/{k}/{n}"] = t
    opt = cls(list(params.values()), **HYPER)
    for step in range(STEPS):
        for n, p in params.items():
            p.grad = bank[step % 8][n] + p.detach() * 0.5
        opt.step()
        if step + 1 in (1, STEPS):
            for n, p in params.items():
                out[f"{tag}/step{step + 1}/{n}"] = p.detach().clone()
                for suffix, t in state_of(opt, p).items():
                    out[f"{tag}/step{step + 1}/{n}{suffix}"] = t


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    out = {}
    # The maps, read off torchao's own state tensors.
    for bits, cls, block in ((8, OptimState8bit, 256), (4, OptimState4bit, 128)):
        out[f"map{bits}_m"] = cls.zeros((block,), signed=True, block_size=block).qmap.clone()
        out[f"map{bits}_v"] = cls.zeros((block,), signed=False, block_size=block).qmap.clone()
    # Quantization of awkward blocks: all zero, tiny values, exact map values and ties, a spread of magnitudes.
    x = torch.randn(8, 256) * torch.logspace(-6, 2, 8).unsqueeze(1)
    x[0] = 0
    x[1] = 1e-14
    x[2, :16] = out["map8_m"][::16] * 3.0
    x[3, 0] = 4.0
    x[3, 1:] = (out["map8_m"][129] + out["map8_m"][130]) / 2 * 4.0  # half-way between two codes
    x = x.reshape(-1)
    out["x"] = x.clone()
    for bits, cls, block in ((8, OptimState8bit, 256), (4, OptimState4bit, 128)):
        for short, signed, src in (("m", True, x), ("v", False, x.abs())):
            q = cls.zeros(x.shape, signed=signed, block_size=block)
            q.copy_(src)
            out[f"q{bits}_{short}_codes"] = q.codes.reshape(-1).clone()
            out[f"q{bits}_{short}_absmax"] = q.scale.reshape(-1).clone()
    trajectory(AdamW8bit, "b8", out)
    trajectory(AdamW4bit, "b4", out)
    out = {k: v.contiguous() for k, v in out.items()}
    tmp = os.path.join(out_dir, "lowbit.safetensors.tmp")
    save_file(out, tmp, metadata={k: str(v) for k, v in HYPER.items()} | {"steps": str(STEPS)})
    os.replace(tmp, os.path.join(out_dir, "lowbit.safetensors"))


if __name__ == "__main__":
    main()
