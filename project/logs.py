"""Log filters of the example project."""

import logging


class OneLineFailures(logging.Filter):
    """Put a failure's exception on its record's line, without the traceback.

    While Redis is down, django-redis logs every cache operation it ignores with a full
    traceback: two per API request (the throttle reads and writes its count). One line each
    says the same: what failed and why.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True
