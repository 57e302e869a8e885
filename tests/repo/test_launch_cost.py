"""What the supervisor leaves out of a job's start without changing it (trainer/distributed/launch.py): the c10d
rendezvous names its events after the methods that record them, and cheap_rendezvous_names gives it the same
names from the frames instead of inspect.stack(), which read the source of every frame (0.3-0.4 CPU-s a job)."""

import inspect

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from trainer.distributed import launch


def _stack_name(depth: int = 2) -> str:
    """torch's own get_method_name (2.13), whatever dynamic_rendezvous.get_method_name is now."""
    if len(inspect.stack()) > depth:
        return inspect.stack()[depth].function
    return "no_method_name"


class _Handler:
    """The pattern of the rendezvous's _record: a step calls _record, which asks for the step's name."""

    def next_rendezvous(self):
        return self._record()

    def _record(self):
        return _stack_name(), launch._frame_name()


def test_the_rendezvous_gets_the_names_inspect_gave_it():
    assert _Handler().next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    assert launch._frame_name(10_000) == _stack_name(10_000) == "no_method_name"
    launch.cheap_rendezvous_names()
    assert dynamic_rendezvous.get_method_name is launch._frame_name
