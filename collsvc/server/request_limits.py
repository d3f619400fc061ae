"""The size of every Coordinator request, bounded field by field and as a whole.

Every field has a limit from :class:`collsvc.options.Limits`: keys, values, failure texts and the last
operation of a progress entry have their own; every other text field (job ids, group names, hosts,
peer addresses, device ids, member secrets) has ``max_name_bytes``; lists of ranks have
``max_world_size`` entries. From these limits follows the largest message each method can need (its
*budget*), and from the budgets the server's gRPC receive limit: gRPC refuses anything bigger before
it reaches us, and a method refuses a message over its own budget before parsing it. What parses is
then checked field by field, so the error names the field and the limit.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits

# The Limits attribute that bounds each text or bytes field, by field name; others: max_name_bytes.
_FIELD_LIMITS: dict[str, str] = {
    "key": "max_key_bytes",
    "value": "max_value_bytes",
    "expected": "max_value_bytes",
    "desired": "max_value_bytes",
    "reason": "max_text_bytes",
    "details_json": "max_text_bytes",
    "last_op": "max_op_bytes",
}
_NAME_LIMIT = "max_name_bytes"
# The Limits attribute that bounds the entries of each repeated field. Lists of ranks and of members
# are refused when longer; extra progress entries are ignored (a member must not fail for using many
# groups), and the message budget still bounds them.
_COUNT_LIMITS: dict[str, str] = {
    "ranks": "max_world_size",
    "progress": "max_progress_groups",
    "members": "max_ranks_per_host",  # JoinBatchRequest
    "on_behalf_of": "max_ranks_per_host",  # BarrierRequest
}
_REFUSED_WHEN_LONGER = frozenset({"ranks", "members", "on_behalf_of"})
# Entries assumed for any other repeated field when computing a budget (give a field that needs more
# its own entry above); a message with more entries still passes while it fits its budget.
_DEFAULT_COUNT = 64

# Messages up to this size are parsed whatever their budget, so that the error names the field at fault.
_MIN_BUDGET = 64 * 1024
_TAG_BYTES = 2  # field numbers below 2048
_LENGTH_BYTES = 5  # a length prefix below 4 GiB
_SCALAR_BYTES = 10  # the longest varint or fixed64
_TEXT_TYPES = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


class RequestLimits:
    """Budgets and field checks for the messages of one service under one :class:`Limits`.

    Args:
        limits: the coordinator's limits.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._budgets: dict[str, int] = {}
        # No field of a message this small can be over its limit: a text field takes more bytes than
        # its length, a list of ranks at least one byte per rank.
        bounds = [*_FIELD_LIMITS.values(), _NAME_LIMIT, *(_COUNT_LIMITS[f] for f in _REFUSED_WHEN_LONGER)]
        self._always_fits = min(int(getattr(limits, name)) for name in bounds)

    def may_exceed(self, size: int) -> bool:
        """Whether a message of ``size`` bytes could hold a field over its limit (else
        :meth:`check_fields` has nothing to find, and the Join or Barrier of every rank skips it)."""
        return size > self._always_fits

    def _limit(self, field: FieldDescriptor) -> tuple[str, int]:
        name = _FIELD_LIMITS.get(field.name, _NAME_LIMIT)
        return name, int(getattr(self.limits, name))

    def _count(self, field: FieldDescriptor) -> int:
        attribute = _COUNT_LIMITS.get(field.name)
        return _DEFAULT_COUNT if attribute is None else int(getattr(self.limits, attribute))

    def budget(self, descriptor: Descriptor) -> int:
        """The most bytes a message of this type may take: every field at its limit, at least 64 KiB."""
        return max(self._largest(descriptor), _MIN_BUDGET)

    def _largest(self, descriptor: Descriptor) -> int:
        cached = self._budgets.get(descriptor.full_name)
        if cached is not None:
            return cached
        total = 0
        for field in descriptor.fields:
            if field.message_type is not None:
                item = _LENGTH_BYTES + self._largest(field.message_type)
            elif field.type in _TEXT_TYPES:
                item = _LENGTH_BYTES + self._limit(field)[1]
            else:
                item = _SCALAR_BYTES
            count = self._count(field) if field.is_repeated else 1
            total += count * (_TAG_BYTES + item)
        self._budgets[descriptor.full_name] = total
        return total

    def max_receive_bytes(self, service: ServiceDescriptor) -> int:
        """The gRPC receive limit that admits every request of ``service`` at its largest."""
        return max(self.budget(method.input_type) for method in service.methods)

    def check_size(self, descriptor: Descriptor, size: int) -> None:
        """Refuses a serialized message bigger than its type's budget, before it is parsed.

        Raises:
            ResourceLimitError: ``size`` is over the budget.
        """
        budget = self.budget(descriptor)
        if size > budget:
            raise ResourceLimitError(
                f"{descriptor.name} of {size} bytes is over the {budget} bytes its fields can take "
                "under this coordinator's limits"
            )

    def check_fields(self, message: Any) -> None:
        """Refuses a parsed message whose text, bytes or rank-list fields are over their limits.

        Raises:
            ResourceLimitError: naming the field (``JoinRequest.job_id``), its size and the limit.
        """
        self._check(message, message.DESCRIPTOR.name)

    def _check(self, message: Any, path: str) -> None:
        for field, value in message.ListFields():
            where = f"{path}.{field.name}"
            if field.is_repeated:
                if field.name in _REFUSED_WHEN_LONGER:
                    attribute = _COUNT_LIMITS[field.name]
                    limit = int(getattr(self.limits, attribute))
                    if len(value) > limit:
                        raise ResourceLimitError(
                            f"{where} has {len(value)} entries, over the limit of {limit} (Limits.{attribute})"
                        )
                items = value
            else:
                items = (value,)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in items:
                    self._check(item, where)
            elif field.type in _TEXT_TYPES:
                attribute, limit = self._limit(field)
                for item in items:
                    size = len(item) if isinstance(item, bytes) else len(item.encode("utf-8"))
                    if size > limit:
                        raise ResourceLimitError(
                            f"{where} is {size} bytes, over the limit of {limit} bytes (Limits.{attribute})"
                        )
