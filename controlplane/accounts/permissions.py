"""Role enforcement for every API view.

Views declare `read_roles` and `write_roles` (sets of Role values); defaults: viewer/operator/admin read
and operator/admin write. A token created without `write_enabled` can never use an unsafe method.
"""

from rest_framework import permissions

from controlplane.accounts.models import ApiToken, Role
from controlplane.accounts.selectors import user_role

READ_ROLES = frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN})
WRITE_ROLES = frozenset({Role.OPERATOR, Role.ADMIN})
ADMIN_ONLY = frozenset({Role.ADMIN})
AGENT_ROLES = frozenset({Role.AGENT, Role.OPERATOR, Role.ADMIN})


class RolePermission(permissions.BasePermission):
    message = "Your role does not allow this action."

    def has_permission(self, request, view) -> bool:
        role = user_role(request.user)
        if role is None:
            return False
        if request.method in permissions.SAFE_METHODS:
            return role in getattr(view, "read_roles", READ_ROLES)
        if isinstance(request.auth, ApiToken) and not request.auth.write_enabled:
            self.message = "This API token is read-only."
            return False
        return role in getattr(view, "write_roles", WRITE_ROLES)
