"""A trainer's side of a weight-update group, run in its own process: rank 0 of the group, broadcasting a
checkpoint's tensors as TRL, verl and OpenRLHF do over SGLang's update_weights_from_distributed."""

from __future__ import annotations

import datetime
import os
import socket

from safetensors.torch import load_file


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def broadcast_checkpoint(rounds: list[tuple[int, int]], folder: str, names: list[str]) -> None:
    """For each (port, die_after) of `rounds`, in order: join the group at 127.0.0.1:port as rank 0 of 2 and broadcast
    `names`' tensors of the checkpoint in `folder`, in order; with `die_after` >= 0 the process exits abruptly after
    that many (a trainer that dies mid-update: the last round)."""
    import torch

    from tokenmill.parallel.weight_sync import init_custom_process_group

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    for port, die_after in rounds:
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, f"weight_update_group_{port}",
                                          datetime.timedelta(seconds=60))
        for sent, name in enumerate(names):
            if sent == die_after:
                os._exit(1)
            torch.distributed.broadcast(tensors[name].contiguous(), src=0, group=group)
        torch.distributed.destroy_process_group(group)
