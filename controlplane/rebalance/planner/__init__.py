"""P:D planner (advisory): `core` decides, `inputs` reads the fleet, `store` keeps state."""
