"""transformers as the oracle of memtrain's packed chat records (data.dataset = chat).

    python scripts/reference/chat_ref.py OUT_DIR      (after hf_models.py has written OUT_DIR/hf/<case>/)

For the hf_models.py cases llama_gqa and gpt2 (vocabulary 97), OUT_DIR/chat/<case>/ holds records in memtrain's chat
format (train.safetensors and val.safetensors: tokens, trained, offsets, vocab_size; 6 records of 4 to 11 tokens, the
second half of each trained) and OUT_DIR/chat/<case>_ref.safetensors:
  loss             the records' summed cross-entropy over their trained tokens / the trained-token count, each record
                   run alone through transformers (input its tokens but the last, labels the next tokens with -100
                   where the record does not train them)
  grad/<hf name>   every parameter's gradient of that loss
Nothing here is computed by memtrain.
"""
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

VOCAB = 97
LENGTHS = [5, 9, 4, 11, 6, 7]


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    os.makedirs(os.path.join(out, "chat"), exist_ok=True)
    g = torch.Generator().manual_seed(2024)
    records = [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]
    trained = []
    for n in LENGTHS:
        m = torch.zeros(n, dtype=torch.uint8)
        m[n // 2:] = 1
        trained.append(m)
    offsets = [0]
    for n in LENGTHS:
        offsets.append(offsets[-1] + n)
    files = {"tokens": torch.cat(records).to(torch.int32), "trained": torch.cat(trained),
             "offsets": torch.tensor(offsets, dtype=torch.int64), "vocab_size": torch.tensor([VOCAB], dtype=torch.int64)}
    count = sum(int(m[1:].sum()) for m in trained)
    for case in ("llama_gqa", "gpt2"):
        folder = os.path.join(out, "chat", case)
        os.makedirs(folder, exist_ok=True)
        save_file(files, os.path.join(folder, "train.safetensors"))
        save_file(files, os.path.join(folder, "val.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf", case), dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model.train()
        total = torch.zeros(())
        for tokens, m in zip(records, trained):
            labels = tokens[1:].clone()
            labels[m[1:] == 0] = -100
            logits = model(input_ids=tokens[:-1].unsqueeze(0)).logits[0]
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / count
            loss.backward()
            total += loss.detach()
        tensors = {"loss": total}
        for name, p in model.named_parameters():
            if p.grad is not None:
                tensors["grad/" + name] = p.grad.detach().contiguous()
        save_file(tensors, os.path.join(out, "chat", case + "_ref.safetensors"))
    print("wrote chat references to %s" % os.path.join(out, "chat"))


if __name__ == "__main__":
    main()
