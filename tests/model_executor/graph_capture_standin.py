"""A CPU stand-in for CUDA graph capture (``ddtree_serve.model_executor.cuda_graph_runner.GraphCapture``; torch.cuda graphs
cannot run without a GPU). It keeps what matters to the runner's correctness:

- ``warm_up(run)`` runs the forward, as the side-stream warm-up does on a GPU, KV writes included;
- ``capture(run)`` runs nothing (a capture records kernels, it launches none) and returns a replay;
- the replay runs the recorded forward on the static buffers' contents at replay time, as a graph replay
  does.

``events`` records the calls in order ("warm_up", "capture", "replay")."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_serve.model_executor.models.output import ModelOutput


class RecordingCapture:
    def __init__(self) -> None:
        self.events: list[str] = []

    def warm_up(self, run: Callable[[], ModelOutput]) -> None:
        self.events.append("warm_up")
        run()

    def capture(self, run: Callable[[], ModelOutput]) -> Callable[[], ModelOutput]:
        self.events.append("capture")

        def replay() -> ModelOutput:
            self.events.append("replay")
            return run()

        return replay
