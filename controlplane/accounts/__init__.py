"""Accounts: users, roles (viewer/operator/admin/agent as groups) and hashed API tokens."""
