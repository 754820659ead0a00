"""A round's logic without the broker: selection and collection, async steps, secure aggregation."""
