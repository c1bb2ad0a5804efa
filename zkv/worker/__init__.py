"""Per-rank worker actor: executes batches of copy ops and acks them."""

from zkv.worker.actor import WorkerActor
from zkv.worker.layers import LayerDoneCounter
from zkv.worker.sidecar import Sidecar

__all__ = ["LayerDoneCounter", "Sidecar", "WorkerActor"]
