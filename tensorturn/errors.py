"""Errors a user can cause. The CLI prints each as one line and exits non-zero."""


class TensorTurnError(Exception):
    """Base class: the message is written for the user and is printed as is."""

    exit_code = 2


class SpecError(TensorTurnError):
    """The run's options are invalid."""


class RecipeError(TensorTurnError):
    """A recipe cannot be found, imported or used."""


class RecipeFault(RecipeError):
    """A recipe's own hook raised an error of its code (:data:`CODE_ERRORS`) where a run
    evaluates: the same code fails the same way on every machine, so the run fails at once with
    the recipe's traceback rather than retrying (a RuntimeError may be a device's fault: retried)."""


# what a hook raises when its code is wrong, not its machine (torch's errors of a device or of
# memory are RuntimeErrors, which these leave out)
CODE_ERRORS: tuple[type[Exception], ...] = (AttributeError, NameError, TypeError, LookupError, ValueError,
                                            AssertionError, ZeroDivisionError, NotImplementedError)


class BrokerError(TensorTurnError):
    """The broker (Redis) cannot be reached."""

    exit_code = 3


class StoreError(TensorTurnError):
    """The object store cannot be reached or an object is missing."""

    exit_code = 3


class StoreURLError(StoreError, SpecError):
    """A store URL written wrong (an unknown scheme, no bucket): the user's to fix, not a store
    that cannot be reached."""

    exit_code = 2


class RunFailed(TensorTurnError):
    """A run ended in the failed state."""

    exit_code = 1


class NotFound(TensorTurnError):
    """A run (or other named thing) does not exist."""
