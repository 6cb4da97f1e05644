"""A 5-field cron expression (minute hour day-of-month month day-of-week), for `bulkgen watch --schedule`.

Fields take `*`, numbers, ranges `a-b`, steps `*/n` and `a-b/n`, and lists `a,b`; day of week is 0-7
(0 and 7 are Sunday). As in cron, when both day fields are restricted a day matching either one fires.
Times are UTC.
"""

from __future__ import annotations

import datetime as dt

_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day of month", 1, 31),
    ("month", 1, 12),
    ("day of week", 0, 7),
)


class CronError(ValueError):
    pass


class Cron:
    def __init__(self, expression: str) -> None:
        parts = expression.split() if isinstance(expression, str) else []
        if len(parts) != 5:
            raise CronError(
                f"schedule {expression!r} must have 5 fields: minute hour day-of-month month "
                "day-of-week, e.g. '*/5 * * * *'"
            )
        self.expression = expression
        sets = [_field(part, *spec, expression) for part, spec in zip(parts, _FIELDS, strict=True)]
        self.minutes, self.hours, self.days, self.months, weekdays = sets
        self.weekdays = {d % 7 for d in weekdays}
        self.any_day, self.any_weekday = parts[2] == "*", parts[4] == "*"

    def _day_matches(self, t: dt.datetime) -> bool:
        day, weekday = t.day in self.days, (t.weekday() + 1) % 7 in self.weekdays  # cron: Sunday is 0
        if self.any_day or self.any_weekday:
            return day and weekday
        return day or weekday

    def next_after(self, after: dt.datetime) -> dt.datetime:
        """The first matching minute strictly after `after` (a UTC datetime)."""
        t = after.replace(second=0, microsecond=0, tzinfo=after.tzinfo or dt.timezone.utc) + dt.timedelta(
            minutes=1
        )
        limit = t + dt.timedelta(days=366 * 5)
        while t < limit:
            if t.month not in self.months:
                t = (t.replace(day=1, hour=0, minute=0) + dt.timedelta(days=32)).replace(day=1)
            elif not self._day_matches(t):
                t = t.replace(hour=0, minute=0) + dt.timedelta(days=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0) + dt.timedelta(hours=1)
            elif t.minute not in self.minutes:
                t += dt.timedelta(minutes=1)
            else:
                return t
        raise CronError(f"schedule {self.expression!r} never fires")


def _field(text: str, name: str, low: int, high: int, expression: str) -> set[int]:
    values: set[int] = set()
    for item in text.split(","):
        try:
            span, _, step_text = item.partition("/")
            step = int(step_text) if step_text else 1
            if span == "*":
                first, last = low, high
            elif "-" in span:
                first, last = (int(x) for x in span.split("-", 1))
            else:
                first = last = int(span)
                if step_text:
                    last = high
        except ValueError:
            raise CronError(
                f"schedule {expression!r}: {name} field {text!r} is not a number, range or step"
            ) from None
        if not (low <= first <= last <= high) or step < 1:
            raise CronError(f"schedule {expression!r}: {name} field {text!r} must stay within {low}-{high}")
        values.update(range(first, last + 1, step))
    return values
