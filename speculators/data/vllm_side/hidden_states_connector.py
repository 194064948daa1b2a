"""Runs inside the vLLM environment (never imported by `speculators`): vLLM's example hidden-states connector with a
synchronous write, so that it works on every platform.

vLLM's `ExampleHiddenStatesConnector` (the KV connector of the `extract_hidden_states` speculative method) copies a
finished request's hidden states into pinned host memory on a CUDA stream and writes them from a thread pool; on a
CPU build the pinned copy kills the engine when the first request finishes. This subclass extracts the request's
slots from the hidden-state cache, writes `hidden_states [T, L, H]` and `token_ids [T]` with safetensors in the
calling thread, releases the file's lock (clients wait on it with `load_hidden_states`) and leaves an event that is
already complete for `get_finished` to poll. vLLM loads it by module path (`kv_connector_module_path`).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


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
        save_file({"hidden_states": hidden.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()},
                  pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX: readers blocked in load_hidden_states go on
        self._req_copy_events[pending.req_id] = _Completed()
