"""A team client written in the original event's style, as a test of running such code here: it imports the
event's names from `client`, takes each symbol's queued requests as a list of PendingRequest, and answers with an
InferenceResponse in an order of its own (the last symbol first)."""
import time
from typing import Dict, List

import numpy as np

from client import BaseInferenceClient, InferenceResponse, PendingRequest


class ExampleModel(BaseInferenceClient):
    def process_batch(self, requests_by_symbol: Dict[str, List[PendingRequest]]) -> InferenceResponse:
        unique_ids, predictions = [], []
        # The i-th queued request of every symbol in one step, so that each symbol's state advances in order.
        for depth in range(max((len(queue) for queue in requests_by_symbol.values()), default=0)):
            requests = [queue[depth] for queue in requests_by_symbol.values() if len(queue) > depth]
            features = np.array([request.features for request in requests], dtype=np.float32)
            step = self.engine.step([request.symbol for request in requests], features)
            unique_ids += [request.unique_id for request in requests]
            predictions += step.tolist()
        return InferenceResponse(unique_ids=unique_ids[::-1], predictions=predictions[::-1],
                                 client_timestamp=time.time())
