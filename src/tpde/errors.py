"""One exception hierarchy: every error tpde raises on purpose is a ``TPDEError``.

Messages name the run, the step and the tensor involved and say what to do next, because the
person reading them is usually looking at a failed job, not at tpde's source.
"""

from __future__ import annotations


class TPDEError(Exception):
    """Base class of every error tpde raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        run: str | None = None,
        step: int | None = None,
        tensor: str | None = None,
    ) -> None:
        self.detail, self.run, self.step, self.tensor = message, run, step, tensor
        where = ", ".join(
            part
            for part in (
                f"run {run!r}" if run is not None else "",
                f"step {step}" if step is not None else "",
                f"tensor {tensor!r}" if tensor is not None else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message)

    def located(self, *, run: str | None = None, step: int | None = None,
                tensor: str | None = None) -> "TPDEError":
        """The same error with the location filled in where it was not known yet."""
        return type(self)(self.detail, run=self.run or run,
                          step=self.step if self.step is not None else step,
                          tensor=self.tensor or tensor)


class StepNotFoundError(TPDEError, FileNotFoundError):
    """The step is not committed in the run, or it was removed."""


class StepPendingError(StepNotFoundError):
    """A checkpoint path whose first save has not committed yet (or was interrupted)."""


class StepExistsError(TPDEError, FileExistsError):
    """A committed step is immutable and cannot be written twice."""


class NotARunError(TPDEError, FileNotFoundError):
    """The location holds no tpde chain."""


class CorruptionError(TPDEError):
    """Stored bytes do not match their hash or cannot be decoded: the chain is damaged."""


class FormatError(CorruptionError):
    """A manifest, chunk table or stream is malformed, truncated or hostile."""


class UnsafeContentError(TPDEError):
    """Restoring would need to unpickle objects that are not on torch's weights-only allowlist."""


class UnsupportedError(TPDEError, TypeError):
    """The value cannot be stored (for example an unsupported tensor type)."""


class StoreError(TPDEError, OSError):
    """The store failed to read or write bytes."""


class WriterConflictError(TPDEError):
    """Another writer holds the run's lease."""


class LossyWarning(UserWarning):
    """A restored step was saved under an error bound: its values are within the bound of the
    saved ones, not bit-exact."""


class UnsafeContentWarning(UserWarning):
    """A saved step holds an object that torch's weights-only unpickler refuses: loading it
    will need ``trusted=True``. Said at save time, so that it is not first met at a resume."""
