"""Hosting a federation: broker, parts and coordinator started and stopped; simulate and workers."""
