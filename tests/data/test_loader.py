from __future__ import annotations

import numpy as np
import torch

from raydiff.data.loader import BatchStream, ImageTable, MicroBatch
from raydiff.data.order import SampleOrder, rank_share


def make_table(n=23, chunk=5):
    images = np.arange(n * 1 * 2 * 2, dtype=np.uint8).reshape(n, 1, 2, 2)
    return images, ImageTable([images[i:i + chunk] for i in range(0, n, chunk)])


def test_gather_across_chunks():
    images, table = make_table()
    indices = np.array([22, 0, 7, 5, 4, 13])
    out = np.empty((6, 1, 2, 2), np.uint8)
    assert np.array_equal(table.gather(indices, out), images[indices]) and len(table) == 23


def test_stream_yields_the_order_for_each_step_and_resumes_exactly():
    images, table = make_table()
    order = SampleOrder(len(images), seed=5)

    def stream(start_step, rank, world, noise=None):
        return BatchStream(table=table, order=order, global_batch=8, share=rank_share(8, world, rank),
                           micro_batch=3, start_step=start_step, pin_memory=False, noise=noise)

    s = stream(0, 0, 1)
    steps = [next(s) for _ in range(4)]
    s.close()
    for step, batches in enumerate(steps):
        assert [len(b.images) for b in batches] == [3, 3, 2]
        expected, _ = order.take(step * 8, 8)
        assert np.array_equal(torch.cat([b.images for b in batches]).numpy(), images[expected])
    resumed = stream(2, 1, 2, noise=(5, 100))  # restart at step 2 as rank 1 of 2: second half of that step's batch
    batches = next(resumed)
    resumed.close()
    assert np.array_equal(torch.cat([b.images for b in batches]).numpy(), images[order.take(2 * 8 + 4, 4)[0]])
    # The same sample gets the same timestep and noise whatever the layout, drawn ahead by the loader or not.
    assert batches[0].noise is not None and steps[2][1].noise is None
    cpu = torch.device("cpu")
    t_resumed, noise_resumed = batches[0].diffusion_inputs(5, 100, cpu)
    t_first, noise_first = steps[2][1].diffusion_inputs(5, 100, cpu)
    assert torch.equal(noise_resumed[0], noise_first[1]) and t_resumed[0] == t_first[1]


def test_to_device_scales_and_flips():
    images = torch.tensor([[[[0, 255]]], [[[0, 255]]]], dtype=torch.uint8)
    batch = MicroBatch(images=images, flips=torch.tensor([False, True]), position=0, indices=np.arange(2))
    x = batch.to_device(torch.device("cpu"), flip=True)
    assert torch.equal(x, torch.tensor([[[[-1.0, 1.0]]], [[[1.0, -1.0]]]]))
    assert torch.equal(batch.to_device(torch.device("cpu"), flip=False)[1], torch.tensor([[[-1.0, 1.0]]]))


def test_loader_errors_reach_the_consumer():
    _, table = make_table()
    s = BatchStream(table=table, order=SampleOrder(99, seed=0), global_batch=4, share=rank_share(4, 1, 0),
                    micro_batch=4, start_step=0, pin_memory=False)  # indices beyond the table
    try:
        raised = False
        for _ in range(50):
            next(s)
    except IndexError:
        raised = True
    finally:
        s.close()
    assert raised


def test_a_loader_that_fails_with_its_queue_full_and_no_reader_ends_at_close():
    """Its error was put in the queue without a timeout: after close() the thread waited for ever, holding its
    (pinned) buffers."""
    import threading
    import time

    class FailingOnItsThirdGather(ImageTable):
        calls = 0

        def gather(self, indices, out):
            self.calls += 1
            if self.calls > 2:
                raise OSError("shard gone")
            return super().gather(indices, out)

    images, _ = make_table(n=10, chunk=10)
    before = set(threading.enumerate())
    s = BatchStream(table=FailingOnItsThirdGather([images]), order=SampleOrder(10, seed=0), global_batch=2,
                    share=rank_share(2, 1, 0), micro_batch=2, start_step=0, pin_memory=False, prefetch_steps=2)
    time.sleep(1.0)  # two steps queued (the prefetch), the third's error waiting for room
    s.close()
    assert not [t for t in set(threading.enumerate()) - before if t.name == "raydiff-loader"]


def test_a_stream_for_a_gpu_leaves_the_diffusion_inputs_to_the_step():
    """With `device_noise` (training on a GPU) the loader thread draws no timesteps or noise: the step draws them
    on its device. Asked for them on a CPU, such a batch gets what the loader would have drawn ahead."""
    images, table = make_table()
    order = SampleOrder(len(images), seed=5)

    def first_step(device_noise):
        s = BatchStream(table=table, order=order, global_batch=8, share=rank_share(8, 1, 0), micro_batch=3,
                        start_step=0, pin_memory=False, noise=(5, 100), device_noise=device_noise)
        batches = next(s)
        s.close()
        return batches

    ahead, left = first_step(False), first_step(True)
    assert all(b.noise is not None and b.timesteps is not None for b in ahead)
    assert all(b.noise is None and b.timesteps is None for b in left)
    cpu = torch.device("cpu")
    for a, b in zip(ahead, left, strict=True):
        (t_a, noise_a), (t_b, noise_b) = a.diffusion_inputs(5, 100, cpu), b.diffusion_inputs(5, 100, cpu)
        assert torch.equal(t_a, t_b) and torch.equal(noise_a, noise_b)
