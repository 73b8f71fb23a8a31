"""A team client's answer to a batch (process_batch's result, or submit_batch's result()), checked one way for
the live runtime (client/runtime.py) and the offline evaluator (local_evaluator.py).

The contract: {"unique_ids": [...], "predictions": float32 [n, 4] in the order of unique_ids, "errors":
{unique_id: why} (optional)}; every request of the batch is either answered once or named under errors with
the reason it was not (e.g. a symbol the engine has no room for). "restarted": [unique_id, ...] (optional) names
requests before which the team client started their symbol's state afresh on its own (a sharded engine's shard lost,
--on-shard-loss reset): the journal says so there (client/journal.py).
"""
from collections import Counter
from typing import NamedTuple

import numpy as np

from client.constants import NUM_TOWERS


class Answer(NamedTuple):
    unique_ids: list[int]
    predictions: np.ndarray  # float32 [len(unique_ids), NUM_TOWERS], row i answers unique_ids[i]
    errors: dict[int, str]  # unique_id -> why it was not answered
    restarted: list[int]  # requests (answered or not) before which their symbol's state started afresh

    def in_order(self, batch_ids) -> np.ndarray:
        """The predictions reordered to `batch_ids` (every one of them answered)."""
        row_of = {uid: row for row, uid in enumerate(self.unique_ids)}
        return self.predictions[[row_of[uid] for uid in batch_ids]]


def check_answer(result, batch_ids, partial=False) -> Answer:
    """`result` parsed and checked against the unique ids of its batch; ValueError saying what is wrong. A partial
    answer (a step answered in parts, some not yet come) may leave requests out."""
    try:
        ids = [int(uid) for uid in result["unique_ids"]]
        predictions = _float32(result["predictions"])
        errors = {int(uid): str(why) for uid, why in (result.get("errors") or {}).items()}
        restarted = [int(uid) for uid in result.get("restarted") or ()]
    except (TypeError, KeyError, ValueError, AttributeError, OverflowError) as exc:
        raise ValueError("process_batch must return {'unique_ids': [...], 'predictions': [n, 4], 'errors': "
                         f"{{unique_id: why}} (optional)}}, got {type(result).__name__}: {exc}") from None
    batch_ids = [int(uid) for uid in batch_ids]
    given = ids + list(errors)
    whole = sorted(given) == sorted(batch_ids)
    if not (whole or partial and len(set(given)) == len(given) and set(given) <= set(batch_ids)):
        missing = [] if partial else sorted(set(batch_ids) - set(given))
        unexpected = sorted(set(given) - set(batch_ids))
        repeated = sorted(uid for uid, times in Counter(given).items() if times > 1)
        raise ValueError(f"process_batch must answer each request of the batch once (or name it under errors): "
                         f"missing ids {missing[:5]}, unexpected ids {unexpected[:5]}, repeated ids {repeated[:5]}")
    if predictions.shape != (len(ids), NUM_TOWERS):
        raise ValueError(f"process_batch returned predictions of shape {predictions.shape} for {len(ids)} ids, "
                         f"expected ({len(ids)}, {NUM_TOWERS})")
    if not set(restarted) <= set(given):
        raise ValueError(f"process_batch's 'restarted' must name requests it answers or names under errors, got "
                         f"{sorted(set(restarted) - set(given))[:5]}")
    return Answer(ids, predictions, errors, restarted)


def _float32(predictions) -> np.ndarray:
    """Predictions as float32, a finite value past float32's range held at its largest: cast, it became inf (with
    numpy's overflow warning), and the runtime refused the request as not finite, its right towers with it (as
    protocol.parse_inference_response holds such a value for the server)."""
    array = np.asarray(predictions)
    if array.dtype.kind == "f" and array.dtype.itemsize > 4:
        limit = np.finfo(np.float32).max
        array = np.where(np.isfinite(array), array.clip(-limit, limit), array)
    return array.astype(np.float32, copy=False)
