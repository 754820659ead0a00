"""The fleet as the coordinator sees it: devices, registration, what is sent them, NACKs."""
