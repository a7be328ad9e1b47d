"""torchao's NF4Tensor (QLoRA's 4-bit NormalFloat with double quantization) as the oracle of memtrain's NF4 base
(models/nf4.h) and of its QLoRA forward and backward.

    python scripts/reference/nf4_ref.py OUT_DIR

Writes
  OUT_DIR/nf4.safetensors:
    levels                        torchao's 16 NF4 levels in bf16
    <case>/x                      a bf16 weight: random, zero (some all-zero blocks and one all-zero group),
                                  tiny (|x| ~ 1e-30), mixed (blocks of magnitudes 1e-4 .. 1e3), wide (a single block
                                  size of 128 and groups of 64: torchao's to_nf4(x, 128, 64))
    <case>/codes, /scales, /factors, /mean   torchao's quantized_data (uint8), quantized_scalers (int8),
                                  quantization_factor and scaler_mean
    <case>/dequantized            torchao's get_original_weight()
  OUT_DIR/hf/nf4_<model>/         a transformers model (llama with grouped-query attention, gpt2) wide enough that its
                                  block linears are whole NF4 groups (llama's k_proj and v_proj, 64 x 128, are not)
  OUT_DIR/hf/nf4_<model>_lora/    a peft-format adapter folder for it (rank 4, alpha 8; A and B random)
  OUT_DIR/hf/nf4_<model>_qlora.safetensors:
    input, target                 a batch
    loss, logits                  QLoRA's on it: every eligible frozen block linear through torchao's linear_nf4 on
                                  to_nf4(W in bf16) (GPT-2's Conv1D weights transposed to (out, in) first), the
                                  adapters as peft adds them (B(A x) alpha / r), everything else fp32
    grad/<peft name>              each adapter parameter's gradient of that loss
    packed/<hf name>/codes ...    torchao's parts for each quantized weight
Nothing here is computed by memtrain.
"""
import json
import os
import shutil
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"
sys.path.insert(0, os.environ.get("MEMTRAIN_TORCHAO", os.path.join(os.path.dirname(sys.prefix), "torchao0.18.0")))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4  # noqa: E402

RANK, ALPHA = 4, 8.0


def parts(t):
    return {"codes": t.quantized_data.contiguous(), "scales": t.quantized_scalers.contiguous(),
            "factors": t.quantization_factor.contiguous(), "mean": t.scaler_mean.reshape(()).contiguous()}


def quantization_cases(out):
    g = torch.Generator().manual_seed(7)
    rows, cols = 256, 128  # 32768 values: 512 blocks of 64, 2 groups of 256
    random = torch.randn(rows, cols, generator=g).bfloat16()
    zero = torch.randn(rows, cols, generator=g).bfloat16()
    zero.view(-1, 64)[3] = 0
    zero.view(-1, 64)[100] = 0
    zero.view(-1, 64)[256:512] = 0  # the second group: every block zero
    tiny = (torch.randn(rows, cols, generator=g) * 1e-30).bfloat16()
    mixed = torch.randn(rows, cols, generator=g)
    scales = 10.0 ** torch.empty(rows * cols // 64).uniform_(-4, 3, generator=g)
    mixed = (mixed.view(-1, 64) * scales.unsqueeze(1)).view(rows, cols).bfloat16()
    wide = torch.randn(rows, cols, generator=g).bfloat16()
    tensors = {"levels": to_nf4(random).nf4.contiguous()}
    for name, x, block, group in (("random", random, 64, 256), ("zero", zero, 64, 256), ("tiny", tiny, 64, 256),
                                  ("mixed", mixed, 64, 256), ("wide", wide, 128, 64)):
        q = to_nf4(x, block, group)
        tensors[name + "/x"] = x.contiguous()
        for k, v in parts(q).items():
            tensors[name + "/" + k] = v
        tensors[name + "/dequantized"] = q.get_original_weight().contiguous()
    save_file(tensors, os.path.join(out, "nf4.safetensors"))


class QLoRALinear(torch.nn.Module):
    """A frozen base linear, in NF4 (torchao) when `quantize`, with peft's adapter beside it when one is given."""

    def __init__(self, weight_out_in, bias, adapter, quantize):
        super().__init__()
        w = weight_out_in.detach()
        self.weight = to_nf4(w.to(torch.bfloat16).contiguous()) if quantize else w.clone()
        self.quantize = quantize
        self.bias = None if bias is None else bias.detach()
        self.adapter = adapter  # (A, B) parameters or None

    def forward(self, x):
        y = linear_nf4(x, self.weight) if self.quantize else F.linear(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        if self.adapter is not None:
            a, b = self.adapter
            y = y + F.linear(F.linear(x, a), b) * (ALPHA / RANK)
        return y


def model_cases():
    llama = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=500.0)
    gpt2 = GPT2Config(vocab_size=128, n_positions=32, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0)
    return {"llama": (LlamaForCausalLM, llama, ["q_proj", "v_proj", "down_proj"]),
            "gpt2": (GPT2LMHeadModel, gpt2, ["c_attn", "c_fc"])}


def write_model(out, name, cls, config, targets):
    torch.manual_seed(11)
    model = cls(config).float().eval()
    base = os.path.join(out, "hf", "nf4_" + name)
    shutil.rmtree(base, ignore_errors=True)
    model.save_pretrained(base, safe_serialization=True)
    gpt = name == "gpt2"
    g = torch.Generator().manual_seed(13)
    adapters, replaced, packed = {}, [], {}
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        is_linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if not is_linear or leaf == "lm_head":
            continue
        w = module.weight.t() if gpt else module.weight  # (out, in)
        out_f, in_f = w.shape
        adapter = None
        if leaf in targets:
            a = torch.nn.Parameter(torch.randn(RANK, in_f, generator=g) * 0.1)
            b = torch.nn.Parameter(torch.randn(out_f, RANK, generator=g) * 0.1)
            adapter = (a, b)
            adapters[path] = adapter
        quantize = w.numel() % (64 * 256) == 0  # whole groups; otherwise the base stays fp32
        if not quantize and adapter is None:
            continue
        new = QLoRALinear(w, module.bias, adapter, quantize)
        if quantize:
            for k, v in parts(new.weight).items():
                packed["packed/" + path + ".weight/" + k] = v
        parent = model.get_submodule(path.rsplit(".", 1)[0])
        setattr(parent, leaf, new)
        replaced.append(path)
    # the adapter folder, as peft's save_pretrained writes it
    folder = base + "_lora"
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    weights = {}
    for path, (a, b) in adapters.items():
        weights["base_model.model." + path + ".lora_A.weight"] = a.detach().contiguous()
        weights["base_model.model." + path + ".lora_B.weight"] = b.detach().contiguous()
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
                   "target_modules": targets, "bias": "none", "fan_in_fan_out": gpt, "modules_to_save": None}, f)
    # QLoRA's loss and adapter gradients on a batch
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=g)
    inp, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model.train()
    logits = model(input_ids=inp).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    loss.backward()
    tensors = {"input": inp, "target": target, "loss": loss.detach(), "logits": logits.detach().contiguous()}
    for path, (a, b) in adapters.items():
        tensors["grad/base_model.model." + path + ".lora_A.weight"] = a.grad.contiguous()
        tensors["grad/base_model.model." + path + ".lora_B.weight"] = b.grad.contiguous()
    tensors.update(packed)
    save_file(tensors, os.path.join(out, "hf", "nf4_" + name + "_qlora.safetensors"))


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    os.makedirs(os.path.join(out, "hf"), exist_ok=True)
    quantization_cases(out)
    for name, (cls, config, targets) in model_cases().items():
        write_model(out, name, cls, config, targets)
    print("wrote torchao NF4 references to %s" % out)


if __name__ == "__main__":
    main()
