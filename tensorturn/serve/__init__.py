"""The inference API (`tensorturn serve`): the app, its tokens and authentication, and the
batcher that runs the model on one thread."""
