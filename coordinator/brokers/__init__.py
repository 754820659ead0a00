"""MQTT brokers: the embedded amqtt broker and ready Mosquitto and NATS setups (broker-config)."""
