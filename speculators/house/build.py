"""Rebuild the house target from scratch: corpus -> tokenizer -> Llama LM -> held-out report, plus datasets.

Run as `speculators build-house --out data/targets/stdlib-lm` (see `data/targets/stdlib-lm/rebuild.sh`).
Steps, each deterministic for a given Python installation and seed:

1. corpus: stdlib source files split by whole module (`corpus.HELD_OUT_MODULES`), language-reference topics;
2. tasks: chat conversations built from the source (`tasks.py`) for training modules, and held-out workloads
   (`data/workloads/*.jsonl`) plus a speculator-training chat dataset (`data/datasets/stdlib-chat/`) on the side;
3. tokenizer: byte-level BPE with the chat template (`tokenizer.py`);
4. model: a small `LlamaForCausalLM` trained with AdamW + warmup/cosine on packed documents for a fixed number
   of optimizer steps (so the result is reproducible, not wall-clock dependent);
5. report: held-out loss per cohort and bits per byte on held-out modules, greedy samples, written to
   `<out>/report.json`; the README numbers come from that file.

It does not run any speculator stage.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from speculators.core.options import BuildHouseOptions
from speculators.house import corpus, tasks
from speculators.house.tokenizer import END_OF_TEXT, render_chat, train_tokenizer

log = logging.getLogger(__name__)

WORKLOAD_MAX_NEW_TOKENS = {
    "code-completion": 64, "docstring-to-code": 128, "prose": 96, "json-tool-call": 64, "copy-heavy": 128,
    "short-output": 16,
}


@dataclass
class BuildConfig:
    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 1024
    seq_len: int = 512
    batch_size: int = 12
    steps: int = 1500
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.05
    chat_copies: int = 1  # how many times the chat tasks appear in the training stream
    workload_rows_per_cohort: int = 48
    dataset_rows: int = 3000
    code_dataset_rows: int = 1000
    threads: int = 2
    compile: bool = True


# ----------------------------------------------------------------------------------------------------------------
# corpus and tasks


def collect(cfg: BuildConfig) -> dict:
    files = corpus.iter_source_files()
    train_files = [f for f in files if not f.held_out]
    held_files = [f for f in files if f.held_out]
    topics = corpus.doc_topics()
    train_tasks: list[tasks.Task] = []
    held_tasks: dict[str, list[tasks.Task]] = {c: [] for c in tasks.COHORTS}
    for f in files:
        per_cohort = tasks.tasks_for(f, cfg.seed)
        for cohort, items in per_cohort.items():
            if f.held_out:
                held_tasks[cohort].extend(items)
            elif cohort != "code-completion":  # raw code is already in the stream as whole files
                train_tasks.extend(items)
    for name, text in topics.items():
        task = tasks.topic_prose(name, text)
        if corpus.topic_held_out(name):
            held_tasks["prose"].append(task)
        else:
            train_tasks.append(task)
    return {"train_files": train_files, "held_files": held_files, "train_tasks": train_tasks,
            "held_tasks": held_tasks, "topics": topics}


def write_workloads(held_tasks: dict[str, list[tasks.Task]], out_dir: Path, rows: int, seed: int) -> dict[str, int]:
    """data/workloads/<cohort>.jsonl from held-out modules only (prompts, no answers)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for cohort, items in held_tasks.items():
        rng = random.Random(f"{seed}:workload:{cohort}")
        chosen = rng.sample(items, min(rows, len(items)))
        path = out_dir / f"{cohort}.jsonl"
        with path.open("w") as fh:
            for i, task in enumerate(chosen):
                row = task.to_row(f"{cohort}-{i:03d}", WORKLOAD_MAX_NEW_TOKENS[cohort], with_answer=False)
                row["source_module"] = task.module
                fh.write(json.dumps(row) + "\n")
        counts[cohort] = len(chosen)
    return counts


def write_chat_dataset(train_tasks: list[tasks.Task], out_dir: Path, rows: int, seed: int) -> int:
    """A speculator-training chat dataset (OpenAI `messages` rows) drawn from TRAINING modules only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}:chat-dataset")
    chats = [t for t in train_tasks if t.messages and not t.module.startswith("topic:")]
    by_cohort: dict[str, list[tasks.Task]] = {}
    for t in chats:
        by_cohort.setdefault(t.cohort, []).append(t)
    per = rows // max(1, len(by_cohort))
    chosen = []
    for cohort in sorted(by_cohort):
        chosen += rng.sample(by_cohort[cohort], min(per, len(by_cohort[cohort])))
    rng.shuffle(chosen)
    with (out_dir / "train.jsonl").open("w") as fh:
        for i, t in enumerate(chosen):
            fh.write(json.dumps({"id": f"stdlib-chat-{i:05d}", "cohort": t.cohort, "messages": t.messages}) + "\n")
    return len(chosen)


def write_code_dataset(files: list[corpus.SourceFile], out_dir: Path, rows: int, seed: int) -> int:
    """Raw code-completion rows (`{"id", "prompt", "completion"}`, no chat template) from TRAINING modules only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pool: list[tasks.Task] = []
    for f in files:
        pool.extend(tasks.code_completion(f, random.Random(f"{seed}:code-dataset:{f.module}")))
    chosen = random.Random(f"{seed}:code-dataset").sample(pool, min(rows, len(pool)))
    with (out_dir / "train.jsonl").open("w") as fh:
        for i, t in enumerate(chosen):
            fh.write(json.dumps({"id": f"stdlib-code-{i:05d}", "prompt": t.prompt, "completion": t.completion}) + "\n")
    return len(chosen)


def training_documents(data: dict, cfg: BuildConfig) -> list[str]:
    docs = [f.text for f in data["train_files"]]
    docs += [render_chat(t.messages) for t in data["train_tasks"] for _ in range(cfg.chat_copies)]
    random.Random(f"{cfg.seed}:docs").shuffle(docs)
    return docs


# ----------------------------------------------------------------------------------------------------------------
# training


def pack(token_docs: list[list[int]], seq_len: int, eot: int):
    stream: list[int] = []
    for ids in token_docs:
        stream.extend(ids)
        stream.append(eot)
    n = (len(stream) - 1) // seq_len
    t = torch.tensor(stream[: n * seq_len + 1], dtype=torch.long)
    inputs = t[:-1].view(n, seq_len)  # [N, S]
    labels = t[1:].view(n, seq_len)  # [N, S]
    return inputs, labels


def lr_at(step: int, cfg: BuildConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_model(cfg: BuildConfig, tokenizer):
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end|>", END_OF_TEXT)]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_positions, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                                               do_sample=False, max_new_tokens=128)
    return model


def train_house_target(model, inputs, labels, cfg: BuildConfig, log) -> list[dict]:
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(inputs.shape[0], generator=g)
    cursor = 0
    history = []
    model.train()

    def loss_of(x, y):
        logits = model(input_ids=x).logits  # [B, S, V]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    # ~1.25x faster on a 2-core CPU; falls back to eager where inductor cannot compile.
    compiled = torch.compile(loss_of) if cfg.compile else loss_of
    t0 = time.time()
    for step in range(cfg.steps):
        if cursor + cfg.batch_size > len(order):
            order = torch.randperm(inputs.shape[0], generator=g)
            cursor = 0
        idx = order[cursor: cursor + cfg.batch_size]
        cursor += cfg.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        try:
            loss = compiled(inputs[idx], labels[idx])
        except Exception as exc:  # inductor unavailable (no compiler): same math, eager
            log(f"torch.compile failed ({type(exc).__name__}); training eagerly")
            compiled = loss_of
            loss = compiled(inputs[idx], labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg.steps - 1:
            elapsed = time.time() - t0
            tok_s = (step + 1) * cfg.batch_size * cfg.seq_len / elapsed
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr_at(step, cfg), 6),
                   "elapsed_s": round(elapsed, 1), "tokens_per_s": round(tok_s, 1)}
            history.append(rec)
            log(json.dumps(rec))
    model.eval()
    return history


# ----------------------------------------------------------------------------------------------------------------
# held-out evaluation


def heldout_report(model, tokenizer, data: dict, cfg: BuildConfig, max_rows: int = 60) -> dict:
    """Held-out loss per cohort (assistant tokens of held-out chat tasks; raw code for code-completion) and bits
    per byte on held-out module source."""
    report: dict = {"per_cohort_loss": {}, "per_cohort_tokens": {}}
    with torch.no_grad():
        for cohort, items in data["held_tasks"].items():
            rng = random.Random(f"{cfg.seed}:report:{cohort}")
            sample = rng.sample(items, min(max_rows, len(items)))
            total, count = 0.0, 0
            for task in sample:
                if task.prompt is not None:
                    prompt_ids = tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
                    answer_ids = tokenizer(task.completion, add_special_tokens=False)["input_ids"]
                    ids = prompt_ids + answer_ids
                    mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
                else:
                    enc = tokenizer.apply_chat_template(task.messages, tokenize=True, return_dict=True,
                                                        return_assistant_tokens_mask=True)
                    ids, mask = enc["input_ids"], enc["assistant_masks"]
                ids, mask = ids[: cfg.max_positions], mask[: cfg.max_positions]
                x = torch.tensor([ids])
                logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)  # [T-1, V]
                nll = -logp.gather(-1, x[0, 1:, None])[:, 0]  # [T-1]
                m = torch.tensor(mask[1:], dtype=torch.bool)
                total += nll[m].sum().item()
                count += int(m.sum())
            report["per_cohort_loss"][cohort] = round(total / max(1, count), 4)
            report["per_cohort_tokens"][cohort] = count
        # bits per byte on held-out module source, chunked windows
        nll_sum, n_bytes = 0.0, 0
        for f in data["held_files"]:
            ids = tokenizer(f.text, add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids), cfg.seq_len):
                chunk = ids[start: start + cfg.seq_len + 1]
                if len(chunk) < 2:
                    continue
                x = torch.tensor([chunk])
                logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits[0].float(), -1)
                nll_sum += -logp.gather(-1, x[0, 1:, None]).sum().item()
            n_bytes += len(f.text.encode())
        report["heldout_code_bits_per_byte"] = round(nll_sum / math.log(2) / n_bytes, 4)
        report["heldout_code_bytes"] = n_bytes
    return report


def greedy_samples(model, tokenizer, data: dict, n: int = 3) -> list[dict]:
    samples = []
    for cohort in ("code-completion", "docstring-to-code", "json-tool-call"):
        for task in data["held_tasks"][cohort][:n]:
            if task.prompt is not None:
                ids = tokenizer(task.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
                prompt_text = task.prompt
            else:
                ids = tokenizer.apply_chat_template(task.messages[:-1], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
                prompt_text = task.messages[-2]["content"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=64, do_sample=False)
            samples.append({"cohort": cohort, "module": task.module, "prompt": prompt_text[-400:],
                            "greedy": tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)})
    return samples


# ----------------------------------------------------------------------------------------------------------------


def build(opts: BuildHouseOptions) -> None:
    """Rebuild the house target into `opts.out` (and the workloads / datasets it is held out from); `data_only`
    writes the data files only. `speculators build-house` calls this."""
    workloads, datasets, code_datasets, data_only = opts.workloads, opts.datasets, opts.code_datasets, opts.data_only
    cfg = BuildConfig()
    if opts.steps is not None:
        cfg.steps = opts.steps
    torch.set_num_threads(cfg.threads)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    # --data-only must not truncate the shipped model's build log (it rewrites data files only)
    log_fh = None if data_only else log_path.open("w")

    def note(msg: str) -> None:
        log.info(msg)
        if log_fh is not None:
            log_fh.write(msg + "\n")
            log_fh.flush()

    t_start = time.time()
    data = collect(cfg)
    counts = write_workloads(data["held_tasks"], Path(workloads), cfg.workload_rows_per_cohort, cfg.seed)
    n_chat = write_chat_dataset(data["train_tasks"], Path(datasets), cfg.dataset_rows, cfg.seed)
    n_code = write_code_dataset(data["train_files"], Path(code_datasets), cfg.code_dataset_rows, cfg.seed)
    note(f"corpus: {len(data['train_files'])} train files, {len(data['held_files'])} held-out files, "
         f"{len(data['train_tasks'])} train chat tasks; workloads {counts}; chat dataset rows {n_chat}; "
         f"code dataset rows {n_code}")
    if data_only:
        return

    docs = training_documents(data, cfg)
    tokenizer = train_tokenizer(docs, cfg.vocab_size)
    note(f"tokenizer: vocab {len(tokenizer)} ({time.time() - t_start:.0f}s)")
    token_docs = tokenizer(docs, add_special_tokens=False)["input_ids"]
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    inputs, labels = pack(token_docs, cfg.seq_len, eot)
    n_tokens = inputs.numel()
    note(f"stream: {n_tokens} tokens in {inputs.shape[0]} sequences of {cfg.seq_len}; "
         f"{sum(len(d.encode()) for d in docs) / n_tokens:.2f} bytes/token")
    model = make_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    note(f"model: {n_params} parameters")
    history = train_house_target(model, inputs, labels, cfg, note)
    train_s = time.time() - t_start
    report = heldout_report(model, tokenizer, data, cfg)
    report["samples"] = greedy_samples(model, tokenizer, data)
    report.update({
        "build_config": asdict(cfg), "parameters": n_params, "train_stream_tokens": n_tokens,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "epochs": round(cfg.steps * cfg.batch_size * cfg.seq_len / n_tokens, 3),
        "final_train_loss": history[-1]["loss"], "train_loss_last_100_steps_mean": None,
        "train_history": history, "build_seconds": round(time.time() - t_start, 1), "train_seconds": round(train_s, 1),
        "python": __import__("sys").version.split()[0], "torch": torch.__version__,
        "held_out_modules": list(corpus.HELD_OUT_MODULES),
        "held_out_topics": sorted(n for n in data["topics"] if corpus.topic_held_out(n)),
        "train_files": len(data["train_files"]), "held_out_files": len(data["held_files"]),
    })
    tail = [h["loss"] for h in history if h["step"] >= cfg.steps - 100]
    report["train_loss_last_100_steps_mean"] = round(sum(tail) / max(1, len(tail)), 4)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    note(json.dumps({k: report[k] for k in ("per_cohort_loss", "heldout_code_bits_per_byte", "build_seconds")}))
    log_fh.close()
