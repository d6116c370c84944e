"""The one exception type for bad data: the message names the file, field or flag and the fix."""


class DataError(ValueError):
    """Bad input data, a damaged or mismatched dataset, or an option the data cannot satisfy.

    Command-line tools print the message as ``error: ...`` and exit with status 2; library callers
    catch it like any ``ValueError``.
    """
