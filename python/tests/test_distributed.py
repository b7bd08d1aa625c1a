"""DistributedDataParallel over sdmha: two gloo processes on localhost end with the weights that
one process reaches on the concatenated batch (examples/python/train_ddp.py is the training)."""

import sys
import time

import torch
import torch.multiprocessing as mp

from conftest import SOURCE_DIR, free_port

sys.path.insert(0, str(SOURCE_DIR / "examples" / "python"))
import train_ddp  # noqa: E402  (spawned processes import it by name: sys.path reaches them)

STEPS = 5
WORLD_SIZE = 2


def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    result = tmp_path / "ddp_state.pt"
    context = mp.start_processes(train_ddp.worker, args=(WORLD_SIZE, free_port(), STEPS, str(result), 0, False),
                                 nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the DDP processes did not finish in 180 s"
    finally:
        for process in context.processes:  # only on failure: they have exited otherwise
            if process.is_alive():
                process.terminate()
                process.join(5)
    ddp_state = torch.load(result)

    single = train_ddp.train(train_ddp.build_model(0), STEPS)
    initial = train_ddp.build_model(0).state_dict()
    for name, weight in single.state_dict().items():
        if name != "key_bias":  # its gradient is zero: a softmax over keys ignores q·bk, equal for all keys
            assert not torch.allclose(weight, initial[name]), f"{name} did not train"
        difference = float((ddp_state[name] - weight).abs().max())
        assert difference <= 1e-10 * (1 + float(weight.abs().max())), f"{name}: DDP and one process differ by {difference}"
