"""DRF authentication for `Authorization: Bearer cp_<prefix>.<secret>` API tokens."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from controlplane.accounts.selectors import token_get_by_plaintext
from controlplane.accounts.services import token_touch
from controlplane.core.context import token_prefix_var


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0] != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed(
                "Authorization header must be 'Bearer cp_<prefix>.<secret>'."
            )
        token = token_get_by_plaintext(header[1])
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked API token.")
        token_touch(token)
        token_prefix_var.set(token.prefix)
        return token.user, token

    def authenticate_header(self, request):
        return self.keyword


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.ApiTokenAuthentication"
    name = "ApiToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "cp_<prefix>.<secret>"}
