"""PyTorch's own tensor parallelism as the oracle of memtrain's (dist.tensor_parallel = 2).

    python scripts/reference/tp_ref.py OUT_DIR      (after hf_models.py and chat_ref.py have written OUT_DIR)

hf_models.py's Llama with grouped-query attention (OUT_DIR/hf/llama_gqa: 4 query heads sharing 2 key/value heads,
vocabulary 97, untied head) is split over two Gloo processes by `torch.distributed.tensor.parallel.parallelize_module`
(a 1-D DeviceMesh): q, k, v, gate and up ColwiseParallel, o and down RowwiseParallel, the token embedding
RowwiseParallel (rows of the vocabulary: 49 + 48) and the head ColwiseParallel (its logits gathered). It trains STEPS steps on chat_ref.py's
six records (OUT_DIR/chat/llama_gqa/train.safetensors), every step on all of them, each record run alone (labels -100
where it does not train): the loss is the summed cross-entropy over the trained tokens / their count, as memtrain's
packed rows define it. Plain SGD (lr LR, no momentum, no weight decay: the update is the gradient, so a wrong gradient
shows in the next step's loss), gradients clipped to CLIP by `clip_grad_norm_`'s rule over the whole gradients.

OUT_DIR/tp/llama_gqa_ref.safetensors holds
  losses       (STEPS,) f64: each step's loss before its update (PyTorch TP, rank 0)
  grad_norms   (STEPS,) f64: each step's gradient norm before clipping (over the whole model, DTensor's)
  plain_losses, plain_grad_norms: the same model trained in one process without splitting (the script stops if the
               two differ by more than 1e-5: the oracle agrees with itself first)
Nothing here is computed by memtrain.
"""
import os
import socket
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU references (make_fixtures.py says why); before torch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

CASE = "llama_gqa"
STEPS = 3
LR = 0.5
CLIP = 1.0
WORLD = 2


def llama_plan(layers, head):
    """PyTorch's tensor-parallel plan for transformers' Llama, as torchtitan splits it without sequence parallelism: q,
    k, v, gate and up ColwiseParallel, o and down RowwiseParallel, the token embedding RowwiseParallel (rows of the
    vocabulary) and `head` for lm_head. Also scripts/bench/torch_tp.py's."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": head}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def records(out):
    f = load_file(os.path.join(out, "chat", CASE, "train.safetensors"))
    tokens, trained, offsets = f["tokens"].long(), f["trained"], f["offsets"].tolist()
    return [(tokens[a:b], trained[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def train(out, split):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf", CASE), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()
    if split:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        plan = llama_plan(len(model.model.layers), ColwiseParallel(output_layouts=Replicate()))
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), plan)
        rows = model.model.embed_tokens.weight.to_local().size(0)
        assert rows == (49 if dist.get_rank() == 0 else 48), rows  # the uneven split memtrain makes too
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=0.0, weight_decay=0.0)
    data = records(out)
    count = sum(int(m[1:].sum()) for _, m in data)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, m in data:
            labels = tokens[1:].clone()
            labels[m[1:] == 0] = -100
            logits = model(input_ids=tokens[:-1].unsqueeze(0)).logits[0]
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / count
            loss.backward()
            total += float(loss.detach())
        # clip_grad_norm_'s rule, by hand: its foreach norm refuses a mix of DTensor (split) and plain (norm) gradients.
        whole = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
        norm = float(torch.sqrt(sum(whole(p.grad).double().pow(2).sum() for p in params)))
        coef = min(1.0, CLIP / (norm + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        losses.append(total), norms.append(norm)
        opt.step()
    return losses, norms


def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    losses, norms = train(out, split=True)
    if rank == 0:
        torch.save({"losses": losses, "grad_norms": norms}, os.path.join(out, "tp", "split.pt"))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "tp"), exist_ok=True)
    mp.spawn(worker, args=(free_port(), out), nprocs=WORLD, join=True)
    split = torch.load(os.path.join(out, "tp", "split.pt"))
    os.remove(os.path.join(out, "tp", "split.pt"))
    plain_losses, plain_norms = train(out, split=False)
    for what, a, b in (("loss", split["losses"], plain_losses), ("gradient norm", split["grad_norms"], plain_norms)):
        for s, (x, y) in enumerate(zip(a, b)):
            if abs(x - y) > 1e-5 * abs(y):
                sys.exit(f"tp_ref.py: PyTorch's tensor parallelism and one process differ in step {s + 1}'s {what}: {x} vs {y}")
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)
    save_file({"losses": f64(split["losses"]), "grad_norms": f64(split["grad_norms"]),
               "plain_losses": f64(plain_losses), "plain_grad_norms": f64(plain_norms)},
              os.path.join(out, "tp", CASE + "_ref.safetensors"))
    print("wrote %s: losses %s, gradient norms %s" % (os.path.join(out, "tp", CASE + "_ref.safetensors"),
                                                     split["losses"], split["grad_norms"]))


if __name__ == "__main__":
    main()
