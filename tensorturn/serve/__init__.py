"""The inference API (`tensorturn serve`): the app and its routes (``app``), the wire format
(``protocol``), running it under uvicorn (``server``), its tokens and authentication (``tokens``,
``auth``), and the batcher that runs the model on one thread (``batching``)."""
