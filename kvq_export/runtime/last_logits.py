"""A decoder graph that computes the logits of each row's last position only, for serving.

A server prefilling a prompt chunk needs the next-token logits of the chunk's last position and nothing else, yet
the exported graph multiplies every position by the ``[hidden, vocab]`` head: for SmolLM2 (vocab 49152) that is a
fifth of a prompt token's arithmetic, and ``chunk x vocab`` floats of output. :func:`last_position_model` returns
the export's graph with a ``Slice`` of the last position put in front of the head; everything before the head is
unchanged, and the weights stay in the export's external data file, which ONNX Runtime reads from the export's
directory. The head must be a ``MatMul``, ``MatMulNBits`` or w8a8 ``QGemmRows`` reached from the ``logits``
output through elementwise nodes only (a cast, a soft-cap); another form returns None and the caller keeps the
full graph.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

LOGITS = "logits"
#: nodes between the head and the ``logits`` output that act on each position alone
ELEMENTWISE = frozenset({"Cast", "Mul", "Div", "Tanh", "Add", "Identity"})
HEADS = frozenset({"MatMul", "MatMulNBits", "QGemmRows"})  # QGemmRows: the w8a8 head (one node per linear)
#: ONNX Runtime's session option naming the folder of a model's external data when the model comes as bytes
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def last_position_model(model_path: str | Path):
    """The graph at ``model_path`` with logits ``[batch, 1, vocab]`` of the last position, or None (see above)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    name, head = LOGITS, None
    while name in producer:
        node = producer[name]
        if node.op_type in HEADS:
            head = node
            break
        if node.op_type not in ELEMENTWISE:
            break
        name = node.input[0]
    if head is None:
        logger.info("%s: no MatMul head reached from the logits through elementwise nodes; full logits kept",
                    model_path)
        return None
    constants = {"kvq.last.starts": -1, "kvq.last.ends": np.iinfo(np.int64).max, "kvq.last.axes": 1}
    graph.initializer.extend(numpy_helper.from_array(np.array([value], dtype=np.int64), key)
                             for key, value in constants.items())
    last = "kvq.last.hidden"
    graph.node.insert(list(graph.node).index(head), helper.make_node(
        "Slice", [head.input[0], *constants], [last], name="kvq.last_position"))
    head.input[0] = last
    for output in graph.output:
        if output.name == LOGITS:
            output.type.tensor_type.shape.dim[1].dim_param = "last"
    return model
