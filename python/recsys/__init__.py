"""recsys in-process: BERT4Rec and Mult-VAE engines written by `recsys convert`, scored by the
recsys Rust engine (the same kernels and answers as the Triton backend and `recsys predict`).

    import recsys
    engine = recsys.Engine("model_repository/bert4rec/1")
    ids, scores = engine.recommend([[10011403, 10011207], [10011739]], k=10)

Every method takes a batch: one sequence of item ids (oldest first, external ids) per user, as
lists or numpy arrays; the batch runs as one engine batch with the GIL released. Unknown ids are
dropped (``strict=True`` raises ValueError instead). Short answers are padded: ids with -1 (int
catalogues; string catalogues return lists of the answer's own length), scores with -inf.
"""

from ._recsys import Engine, RecsysError, __version__, convert, evaluate

__all__ = ["Engine", "RecsysError", "convert", "evaluate", "__version__"]
