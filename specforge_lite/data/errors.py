"""The error every data stage raises for one unusable row: the loader counts these and skips them."""


class MalformedRow(ValueError):
    """A row that cannot be used; the loader counts these and skips them."""
