"""The errors of the data stages: one unusable row (counted and skipped), and data that cannot be used at all."""

from ..errors import UserError


class MalformedRow(ValueError):
    """A row that cannot be used; the loader counts these and skips them."""


class DataError(UserError):
    """Data that no run can use (a source that cannot be read, too many unusable rows), with the fix."""
