"""Train bulkgen's bundled default model: a few-million-parameter Llama and its byte-level BPE tokenizer.

    nice -n 10 python jobs/train_tiny.py --out bulkgen/models/bundled          # the shipped run
    python jobs/train_tiny.py --out /tmp/tiny --steps 20 --minutes 1            # a smoke run

This is the project's one training job, so it shows what training has that inference does not: a loss,
gradients from backprop, an optimizer (AdamW) whose state is twice the weights again, a learning-rate
schedule, and a held-out split that says whether the model learned English or memorised its data.

The text is prose offline on any install: Python's own documentation (`pydoc_data.topics`, in every
CPython, PSF licence) plus the README of each installed package whose licence is permissive (MIT, BSD,
Apache, PSF, ISC; the list goes into training_summary.json), with code, tables and headings dropped. Each paragraph is seen twice,
as plain text and inside the chat template (user = its first sentence, assistant = the rest), so both
/v1/completions and /v1/chat/completions continue with English and end with <|end|>. Everything is
seeded; with the same installed packages and a fixed --steps (the --minutes cap not reached) a rerun
gives the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bulkgen.lab.memory import LLAMA_3_2_1B, LLAMA_3_8B, LlamaShape, MemoryRow, format_memory_table
from bulkgen.lab.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

SOURCE = f"Python {platform.python_version()} documentation (pydoc_data.topics, PSF licence)"
PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC")
PROMPTS = ["The list is", "A function is", "When the interpreter"]
CHAT = [{"role": "user", "content": "Tell me about exceptions."}]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


# ---- data -------------------------------------------------------------------------------------------


def prose_paragraphs() -> tuple[list[str], list[str]]:
    """Prose paragraphs (one line each) and where they came from: the Python documentation, then the
    long descriptions of installed packages under a permissive licence. Code, tables, headings dropped."""
    from pydoc_data.topics import topics

    blocks = [b for key in sorted(topics) for b in topics[key].split("\n\n")]
    sources = [SOURCE]
    for name, version, text in permissive_descriptions():
        blocks += text.split("\n\n")
        sources.append(f"{name} {version}")
    paragraphs = {_clean(b) for b in blocks if _is_prose(b)}
    return sorted(p for p in paragraphs if len(p) >= 60), sources


def permissive_descriptions():
    """(name, version, README text) of installed distributions whose licence is in PERMISSIVE."""
    from importlib.metadata import distributions

    seen = {}
    for dist in distributions():
        meta = dist.metadata
        licence = " ".join([meta.get("License-Expression") or "", *(meta.get_all("Classifier") or [])])
        if (
            meta["Name"]
            and meta["Name"] != "bulkgen"
            and any(p in licence for p in PERMISSIVE)
            and "GPL" not in licence
        ):
            seen[meta["Name"].lower()] = (meta["Name"].lower(), meta["Version"], meta.get_payload() or "")
    return [seen[k] for k in sorted(seen)]


def _clean(block: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", block)  # markdown links: keep the words
    text = re.sub(r"\[\d+\]|[*`]", "", text)  # footnote marks, emphasis, code ticks
    return re.sub(r"\s+", " ", text).strip()


def _is_prose(block: str) -> bool:
    lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
    if not lines or any(s in block for s in ("::=", "+--", ">>>", "| ", "://", "<", "{", "$ ", "```", "..")):
        return False
    if any(re.fullmatch(r"[*=\-~^#]{3,}", ln) or ln.startswith("#") for ln in lines):
        return False
    text = _clean(block)
    return text[-1:] in ".!?" and sum(c.isalpha() or c == " " for c in text) / len(text) >= 0.85


def split_heldout(paragraphs: list[str], seed: int, fraction: float) -> tuple[list[str], list[str]]:
    shuffled = list(paragraphs)
    random.Random(seed).shuffle(shuffled)
    n = max(1, int(len(shuffled) * fraction))
    return shuffled[n:], shuffled[:n]


def render(paragraphs: list[str], tokenizer, seed: int) -> list[str]:
    """Each paragraph as plain text and as a chat (its first sentence asked, the rest answered)."""
    rng = random.Random(seed)
    docs = []
    for text in paragraphs:
        docs.append(text + "<|end|>\n")
        parts = SENTENCE_END.split(text, maxsplit=1)
        if len(parts) < 2 or len(parts[1]) < 40:
            continue
        messages = [{"role": "user", "content": parts[0]}, {"role": "assistant", "content": parts[1]}]
        if rng.random() < 0.3:  # a system turn the answer does not depend on, as in most batch files
            messages.insert(0, {"role": "system", "content": SENTENCE_END.split(rng.choice(paragraphs))[0]})
        docs.append(tokenizer.apply_chat_template(messages, tokenize=False))
    rng.shuffle(docs)
    return docs


def token_stream(docs: list[str], tokenizer) -> torch.Tensor:
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def train_tokenizer(paragraphs: list[str], vocab_size: int):
    """Byte-level BPE (any text round-trips), the chat specials first (ids 0..4), and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(paragraphs, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        model_max_length=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def unigram_baseline(train: torch.Tensor, heldout_targets: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) on the held-out targets of a unigram model fitted on the training split."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0  # add-one: no token is impossible
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout_targets].mean())


# ---- model and training -----------------------------------------------------------------------------


def build_model(tokenizer, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).float()


def batches(stream: torch.Tensor, batch: int, length: int, seed: int):
    """Endless random windows of length+1 tokens: inputs and next-token targets."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
        rows = torch.stack([stream[s : s + length + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


def heldout_windows(stream: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(stream) - 1) // length
    x = stream[: n * length].view(n, length)
    y = stream[1 : n * length + 1].view(n, length)
    return x, y


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, x: torch.Tensor, y: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    total = sum(
        float(loss_of(model, x[i : i + batch], y[i : i + batch])) * len(x[i : i + batch])
        for i in range(0, len(x), batch)
    )
    model.train()
    return total / len(x)


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak; progress runs 0..1."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer_for(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def train(model, stream, heldout, args) -> dict:
    """Forward, loss, backprop, clip, AdamW step; the schedule follows steps or the clock, whichever ends first."""
    from tqdm.auto import tqdm

    opt = optimizer_for(model, args.lr, args.weight_decay)
    data = batches(stream, args.batch, args.context, args.seed)
    start, history, step = time.monotonic(), [], 0
    bar = tqdm(total=args.steps, desc="train", unit="step", mininterval=2.0)
    while True:
        progress = max(step / args.steps, (time.monotonic() - start) / (60 * args.minutes))
        if progress >= 1:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, args.lr)
        x, y = next(data)
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        history.append(loss.item())
        bar.update(1)
        bar.set_postfix(
            loss=f"{sum(history[-20:]) / len(history[-20:]):.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}"
        )
        if args.eval_every and step % args.eval_every == 0:
            bar.write(f"step {step}: held-out loss {evaluate(model, *heldout):.3f}")
    bar.close()
    return {
        "steps": step,
        "seconds": round(time.monotonic() - start, 1),
        "first_loss": history[0],
        "last_loss": sum(history[-20:]) / len(history[-20:]),
        "stopped_by": "steps" if step >= args.steps else "clock",
    }


# ---- after training: samples, memory, files ----------------------------------------------------------


@torch.no_grad()
def completions(model, tokenizer, seed: int) -> list[dict]:
    """Greedy and sampled continuations of plain prompts and of one chat, to show what the model writes."""
    model.eval()
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    out = []
    for prompt in [*PROMPTS, chat]:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        for mode in ("greedy", "sampled"):
            torch.manual_seed(seed)
            sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95} if mode == "sampled" else {}
            gen = model.generate(
                ids,
                max_new_tokens=40,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
            text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            out.append(
                {
                    "prompt": CHAT[0]["content"] if prompt == chat else prompt,
                    "chat": prompt == chat,
                    "mode": mode,
                    "completion": text,
                }
            )
    return out


def memory_rows(model, context: int, batch: int) -> list[MemoryRow]:
    own = LlamaShape.from_config("bulkgen-tiny (this model)", model.config)
    tiny_context = min(context, model.config.max_position_embeddings)
    return [
        MemoryRow(own, tiny_context, batch),
        MemoryRow(LLAMA_3_2_1B, context, batch),
        MemoryRow(LLAMA_3_8B, context, batch),
    ]


def model_card(summary: dict, table: str) -> str:
    samples = "\n".join(
        f"- {s['mode']}, {'chat' if s['chat'] else 'text'} `{s['prompt']}` → `{s['completion'].strip()}`"
        for s in summary["completions"]
    )
    return f"""# bulkgen-tiny

A {summary["parameters"] / 1e6:.1f} M-parameter Llama trained from scratch by `jobs/train_tiny.py`, so that
bulkgen's quickstart prints English offline. It knows nothing: it writes Python-documentation-flavoured
prose, often untrue. Serve a real model with `--model NAME=PATH`.

- Text: prose paragraphs of the {summary["source"]} and of the long descriptions (READMEs) of
  {len(summary["packages"])} installed packages under MIT, BSD, Apache, PSF or ISC licences (listed in
  training_summary.json); {summary["train_tokens"]:,} training and {summary["heldout_tokens"]:,} held-out tokens
  (held-out = {summary["heldout_fraction"]:.0%} of paragraphs, seed {summary["seed"]}).
- Tokenizer: byte-level BPE, {summary["vocab_size"]:,} tokens, chat template `<|role|>\\ntext<|end|>\\n`;
  tools Hermes-style (their JSON schemas in a system block inside `<tools></tools>`, calls as
  `<tool_call>{{"name": ..., "arguments": ...}}</tool_call>`, results as a `tool` turn), never trained on:
  forced calls (`tool_choice`) come out valid through constrained decoding, free ones rarely.
- Training: {summary["steps"]} AdamW steps of {summary["batch"]} x {summary["context"]} tokens,
  {summary["seconds"] / 60:.1f} min on {summary["threads"]} CPU threads.
- Held-out loss {summary["heldout_loss"]:.3f} nats/token (shipped bf16 weights: {summary["heldout_loss_bf16"]:.3f})
  against {summary["unigram_baseline"]:.3f} for a unigram model fitted on the training split.

## Samples

{samples}

## Memory: training against inference

{table}

Activations are excluded on both sides.
"""


def save(model, tokenizer, out: Path, summary: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # bf16 on disk halves the package; the engine upcasts
    tokenizer.save_pretrained(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(model_card(summary, table))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the Hugging Face model")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock cap; the LR schedule follows it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of paragraphs held out")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--memory-context", type=int, default=4096, help="context for the memory table")
    p.add_argument("--memory-batch", type=int, default=16, help="sequences in flight for the memory table")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    paragraphs, sources = prose_paragraphs()
    train_paras, held_paras = split_heldout(paragraphs, args.seed, args.heldout)
    tokenizer = train_tokenizer(train_paras, args.vocab)
    stream = token_stream(render(train_paras, tokenizer, args.seed), tokenizer)
    heldout = heldout_windows(
        token_stream(render(held_paras, tokenizer, args.seed + 1), tokenizer), args.context
    )
    baseline = unigram_baseline(stream, heldout[1].reshape(-1), len(tokenizer))
    model = build_model(tokenizer, args)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(train_paras)} training / {len(held_paras)} held-out paragraphs; {len(stream):,} training tokens, "
        f"{heldout[1].numel():,} held-out targets; vocab {len(tokenizer)}; {params / 1e6:.2f} M parameters"
    )
    untrained = evaluate(model, *heldout)
    print(
        f"unigram baseline on the held-out split: {baseline:.3f} nats/token; untrained model: {untrained:.3f}"
    )
    run = train(model, stream, heldout, args)
    loss = evaluate(model, *heldout)
    loss_bf16 = evaluate(model.to(torch.bfloat16).float(), *heldout)
    print(
        f"held-out loss {loss:.3f} (bf16 weights {loss_bf16:.3f}) vs unigram {baseline:.3f} nats/token; "
        f"{run['steps']} steps in {run['seconds'] / 60:.1f} min (stopped by {run['stopped_by']})"
    )
    samples = completions(model, tokenizer, args.seed)
    for s in samples:
        print(f"[{s['mode']}{' chat' if s['chat'] else ''}] {s['prompt']!r} -> {s['completion']!r}")
    table = format_memory_table(memory_rows(model, args.memory_context, args.memory_batch))
    print("\nMemory, training vs inference (activations excluded):\n" + table)
    summary = {
        "source": SOURCE,
        "packages": sources[1:],
        "seed": args.seed,
        "heldout_fraction": args.heldout,
        "train_tokens": len(stream),
        "heldout_tokens": heldout[1].numel(),
        "vocab_size": len(tokenizer),
        "parameters": params,
        "batch": args.batch,
        "context": args.context,
        "threads": torch.get_num_threads(),
        **run,
        "untrained_heldout_loss": untrained,
        "heldout_loss": loss,
        "heldout_loss_bf16": loss_bf16,
        "unigram_baseline": baseline,
        "completions": samples,
    }
    save(model, tokenizer, args.out, summary, table)
    print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
