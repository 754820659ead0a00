"""The coordinator's players: who plays a run's rounds, and the phases around them.

The coordinator (coordinator/server.py) builds its collaborators, runs, publishes STATUS and
routes each message; what a round is depends on the run's mode, and lives here behind one small
protocol (`base.RoundPlayer`: play a round or step, react to a HELLO or an offline device, take
an update outside a request):
- `sync`: synchronous rounds (select, TRAIN, collect, aggregate; late updates);
- `secure`: synchronous rounds under secure aggregation (the SECAGG stages around TRAIN);
- `asynchronous`: buffered asynchronous steps (`--mode async`);
and the pieces they share: `context` (the run's collaborators and the reply pacing),
`exchange` (one request and its replies: admission, refusals), `evaluation` (EVALUATE and the
accuracy released), `round_loop` (one round from its training to its record), `release_phase`
(the released representation after training, FETCH) and `run_state` (resume and checkpoints).
"""
