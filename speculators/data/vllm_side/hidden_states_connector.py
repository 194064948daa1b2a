"""Runs inside the vLLM environment (never imported by `speculators`): vLLM's example hidden-states connector with a
synchronous write, so that it works on every platform.

vLLM's `ExampleHiddenStatesConnector` (the KV connector of the `extract_hidden_states` speculative method) copies a
finished request's hidden states into pinned host memory on a CUDA stream and writes them from a thread pool; on a
CPU build the pinned copy kills the engine when the first request finishes. This subclass extracts the request's
slots from the hidden-state cache, writes `hidden_states [T, L, H]` and `token_ids [T]` with safetensors in the
calling thread, releases the file's lock (clients wait on it with `load_hidden_states`) and leaves an event that is
already complete for `get_finished` to poll. vLLM loads it by module path (`kv_connector_module_path`).

`RecordingHiddenStatesConnector` is the one a recording replica serves with (`speculators record-vllm`,
adapt/vllm_recording.py): for every request that finished normally (stop or length; an aborted one is not written)
it writes the hidden states of the prompt AND the generated tokens but the last (never forwarded), plus
`num_prompt_tokens`, `final_token` and `temperature`, to a temporary name renamed into place, so the collector never
reads half a file. It takes no lock (`use_synchronization_lock: false`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.request import RequestStatus


class _Completed:
    """Stands in for the copy event `get_finished` polls: the write already happened."""

    def query(self) -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The example connector, writing each finished request's hidden states before it reports the request done."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()  # [n_blocks * block]
        count = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), count)  # [T, L, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tensors = {"hidden_states": hidden.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}
        if isinstance(pending, RecordedSave):
            tensors.update({"num_prompt_tokens": torch.tensor([pending.num_prompt_tokens]),
                            "final_token": torch.tensor([pending.final_token]),
                            "temperature": torch.tensor([pending.temperature], dtype=torch.float32)})
            save_file(tensors, pending.filename + ".part")
            os.replace(pending.filename + ".part", pending.filename)  # the collector only ever sees whole files
        else:
            save_file(tensors, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX: readers blocked in load_hidden_states go on
        self._req_copy_events[pending.req_id] = _Completed()


@dataclass
class RecordedSave(PendingSave):
    """A finished request to record: its pending save, plus what the training row needs besides the hidden states."""

    num_prompt_tokens: int = 0
    final_token: int = -1
    temperature: float = 0.0


RECORDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class RecordingHiddenStatesConnector(SyncHiddenStatesConnector):
    """Records every request that finished normally: prompt + generated tokens (see the module docstring)."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        filename = self._request_filenames.pop(req_id, None)
        self._pending_saves.pop(req_id, None)
        tokens = list(request.all_token_ids)
        prompt = list(request.prompt_token_ids or [])
        if filename is None or request.status not in RECORDED or not prompt or len(tokens) <= len(prompt):
            return False, None  # aborted, never scheduled, embeddings only or nothing generated: not recorded
        params = request.sampling_params
        self._pending_saves[req_id] = RecordedSave(
            req_id=req_id, filename=filename, token_ids=torch.tensor(tokens[:-1]), block_ids=list(block_ids),
            num_prompt_tokens=len(prompt), final_token=int(tokens[-1]),
            temperature=float(params.temperature) if params is not None else 0.0)
        return True, None
