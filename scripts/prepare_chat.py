#!/usr/bin/env python3
"""Chat and instruction records -> memtrain's packed-record files (data.dataset = chat).

  prepare_chat.py --tokenizer DIR --train train.jsonl [--val val.jsonl | --val-fraction 0.05] --out DIR
                  [--max-tokens 512] [--on-long truncate|drop] [--chat-template FILE.jinja]
  prepare_chat.py --austen TEXT_FILE --tokenizer DIR --out DIR     (an example set built from a novel)

Each JSONL line is a record: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} or
{"prompt": "...", "response": "..."} ("completion" is taken for "response"). The tokenizer's chat template (or
--chat-template; a tokenizer without one gets a plain <|role|> template, printed) renders each conversation; its
tokens are the tokenizer's ids of that text, as transformers' apply_chat_template(messages, tokenize=True) gives them.
The loss trains on the assistant's turns only: a token is trained when its characters lie in the text an assistant
message adds to the rendering (its content and the template's end-of-turn after it), found by rendering the
conversation up to each assistant turn.

OUT/train.safetensors and OUT/val.safetensors hold (docs/DATA.md):
  tokens   (N,) int32    every kept record's ids, one after another
  trained  (N,) uint8    1 for a token the loss trains on
  offsets  (R + 1,) int64  record r is tokens[offsets[r]:offsets[r + 1]]
  vocab_size (1,) int64  the tokenizer's vocabulary
and OUT/summary.json counts records kept, truncated and dropped, with each bad record's line and reason. Bad
records (not JSON, no messages, an unknown role, no assistant turn, an empty answer, longer than --max-tokens with
--on-long drop) are reported by line number and left out; the files are written to OUT.partial and renamed, so a
failure leaves nothing half-written.
"""
import argparse
import json
import os
import random
import shutil
import sys

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROLES = {"system", "user", "assistant"}


def load_tokenizer(folder, template_file):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # a bare tokenizer.json (memtrain's prepared BPE sets)
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    if template_file:
        tok.chat_template = open(template_file).read()
    elif not getattr(tok, "chat_template", None):
        print("prepare_chat: the tokenizer has no chat template; using " + repr(DEFAULT_TEMPLATE))
        tok.chat_template = DEFAULT_TEMPLATE
    return tok


def messages_of(record):
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' is not a non-empty list")
    elif "prompt" in record:
        answer = record.get("response", record.get("completion"))
        if answer is None:
            raise ValueError("a prompt without 'response' (or 'completion')")
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    else:
        raise ValueError("neither 'messages' nor 'prompt'")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} lacks 'role' or 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role '{m['role']}' (expected system, user or assistant)")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}'s content is not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message (nothing to train on)")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise ValueError("an empty assistant answer")
    return messages


def encode(tok, messages):
    """The conversation's ids and, per id, whether an assistant turn wrote it."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
        upto = tok.apply_chat_template(messages[:k + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            raise ValueError("the chat template does not render the conversation incrementally (an earlier turn "
                             "changes when a later one follows): the assistant's tokens cannot be located")
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, trained = enc["input_ids"], []
    for a, b in enc["offset_mapping"]:
        trained.append(1 if any(lo <= a and b <= hi and b > a for lo, hi in spans) else 0)
    return ids, trained


def prepare(tok, lines, max_tokens, on_long, report, split):
    import torch
    tokens, trained, offsets = [], [], [0]
    for number, line in lines:
        if not line.strip():
            continue
        try:
            messages = messages_of(json.loads(line))
            ids, mask = encode(tok, messages)
        except json.JSONDecodeError as e:
            report["dropped"].append({"split": split, "line": number, "reason": f"not JSON ({e})"})
            continue
        except ValueError as e:
            report["dropped"].append({"split": split, "line": number, "reason": str(e)})
            continue
        if len(ids) > max_tokens:
            if on_long == "drop":
                report["dropped"].append({"split": split, "line": number,
                                          "reason": f"{len(ids)} tokens, over --max-tokens {max_tokens}"})
                continue
            ids, mask = ids[:max_tokens], mask[:max_tokens]
            report["truncated"].append({"split": split, "line": number, "tokens": len(ids)})
        if sum(mask[1:]) == 0:
            report["dropped"].append({"split": split, "line": number, "reason": "no trained token left (truncated?)"})
            continue
        tokens += ids
        trained += mask
        offsets.append(len(tokens))
    if len(offsets) < 2:
        raise SystemExit(f"prepare_chat: no usable record in the {split} split")
    report["records"][split] = len(offsets) - 1
    report["trained_tokens"][split] = int(sum(trained))
    report["tokens"][split] = len(tokens)
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "trained": torch.tensor(trained, dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.int64), "vocab_size": torch.tensor([len(tok)], dtype=torch.int64)}


def austen_records(text_file, count=2000, seed=0):
    """'Continue this passage' records from a novel: a paragraph's opening asks, the next sentences answer."""
    text = open(text_file, encoding="utf-8").read()
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    paragraphs = [p for p in paragraphs if len(p) > 200]
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    out = []
    for p in paragraphs[:count]:
        cut = p.find(". ", 60)
        if cut < 0 or cut > len(p) - 40:
            continue
        head, tail = p[:cut + 1], p[cut + 2:cut + 2 + 300]
        out.append(json.dumps({"messages": [{"role": "user", "content": "Continue this passage: " + head},
                                            {"role": "assistant", "content": tail}]}))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--train")
    ap.add_argument("--val")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--austen", help="build 'continue this passage' records from this text file instead of --train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--on-long", choices=["truncate", "drop"], default="truncate")
    ap.add_argument("--chat-template")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from safetensors.torch import save_file
    tok = load_tokenizer(a.tokenizer, a.chat_template)
    if a.austen:
        lines = list(enumerate(austen_records(a.austen, seed=a.seed), start=1))
    elif a.train:
        lines = list(enumerate(open(a.train, encoding="utf-8").read().split("\n"), start=1))
    else:
        raise SystemExit("prepare_chat: --train FILE.jsonl or --austen TEXT_FILE is needed")
    if a.val:
        val_lines = list(enumerate(open(a.val, encoding="utf-8").read().split("\n"), start=1))
    else:  # the tail of --train, keeping their line numbers
        keep = [(n, l) for n, l in lines if l.strip()]
        cut = max(1, int(round(len(keep) * (1 - a.val_fraction))))
        lines, val_lines = keep[:cut], keep[cut:]
    report = {"records": {}, "tokens": {}, "trained_tokens": {}, "truncated": [], "dropped": [],
              "tokenizer": a.tokenizer, "max_tokens": a.max_tokens, "on_long": a.on_long}
    train = prepare(tok, lines, a.max_tokens, a.on_long, report, "train")
    val = prepare(tok, val_lines, a.max_tokens, a.on_long, report, "val")
    partial = a.out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(train, os.path.join(partial, "train.safetensors"))
    save_file(val, os.path.join(partial, "val.safetensors"))
    with open(os.path.join(partial, "summary.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(a.out, ignore_errors=True)
    os.rename(partial, a.out)
    for d in report["dropped"]:
        print(f"prepare_chat: {d['split']} line {d['line']}: dropped: {d['reason']}")
    for t in report["truncated"]:
        print(f"prepare_chat: {t['split']} line {t['line']}: truncated to {t['tokens']} tokens")
    print(f"prepare_chat: wrote {a.out}: {report['records']['train']} training and {report['records']['val']} validation "
          f"records ({report['trained_tokens']['train']} of {report['tokens']['train']} training tokens trained), "
          f"{len(report['truncated'])} truncated, {len(report['dropped'])} dropped")


if __name__ == "__main__":
    main()
