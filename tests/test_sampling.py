"""Client sampling is a function of the seed, the round and the clients' identities: never of
Flower's node ids, which a simulation draws anew at every launch."""

import logging
import random
import time

import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, Metadata, RecordDict

from fedact_app.algorithms import ALGORITHMS
from fedact_app.node_config import client_identity
from fedact_app.config import compose
from fedact_app.sampling import IDENTITY_RECORD, client_key, sample_clients, sample_count
from fedact_app.strategy import AlgorithmStrategy

ROUNDS = range(1, 31)


@pytest.fixture(autouse=True)
def in_a_run(monkeypatch):
    """Messages are made inside a ServerApp's run, whose id Flower keeps per process."""
    from flwr.supercore.task_identity import TaskIdentity
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class QueryGrid:
    """The Grid calls the strategy's sampling makes, over nodes with the given node configs: a
    QUERY message is answered as the ClientApp does (``client_identity``), or with an error
    reply where the ClientApp would raise."""

    def __init__(self, node_configs: dict[int, dict], silent=()):
        self.node_configs = node_configs
        self.silent = set(silent)  # nodes that never answer
        self.pushed: dict[str, Message] = {}
        self.queries = 0

    def get_node_ids(self):
        return list(self.node_configs)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            assert message.metadata.message_type == MessageType.QUERY
            self.queries += 1
            ids.append(f"q{len(self.pushed)}")
            self.pushed[ids[-1]] = message
        return ids

    def pull_messages(self, message_ids):
        return [self.answer(i, self.pushed[i].metadata.dst_node_id) for i in message_ids
                if self.pushed[i].metadata.dst_node_id not in self.silent]

    def answer(self, message_id: str, node: int) -> Message:
        metadata = Metadata(run_id=1, message_id=f"r{message_id}", src_node_id=node, dst_node_id=0,
                            reply_to_message_id=message_id, group_id="", created_at=time.time(), ttl=60.0,
                            message_type=MessageType.QUERY)
        try:
            identity = client_identity(self.node_configs[node])
        except ValueError as err:
            return Message(metadata=metadata, error=Error(code=0, reason=str(err)))
        return Message(metadata=metadata, content=RecordDict({IDENTITY_RECORD: ConfigRecord(identity)}))


def simulation_grid(num_clients: int, launch: int) -> QueryGrid:
    """Partition i on a node with a random 63-bit id, new at every ``launch``, as Flower's simulation does."""
    rng = random.Random(launch)
    return QueryGrid({rng.getrandbits(63): {"partition-id": i, "num-partitions": num_clients}
                      for i in range(num_clients)})


def strategy(algorithm="fedact", seed=2, fraction_train=0.25, fraction_evaluate=0.0, num_clients=20,
             node_wait_timeout=300.0):
    cfg = compose([f"algorithm={algorithm}"]).algorithm
    return AlgorithmStrategy(ALGORITHMS[algorithm].server(cfg, ["w"]), trainable=["w"], local_steps=5,
                             lr_schedule=lambda r: 0.1, fraction_train=fraction_train, min_train_nodes=2,
                             fraction_evaluate=fraction_evaluate, seed=seed, expected_nodes=num_clients,
                             node_wait_timeout=node_wait_timeout)


def partitions_sampled(strategy_, grid, purpose="train", fraction=None) -> list[list[int]]:
    fraction = strategy_.fraction_train if fraction is None else fraction
    return [[grid.node_configs[node]["partition-id"]
             for node in strategy_.sample_nodes(grid, fraction, 2, r, purpose)] for r in ROUNDS]


def test_the_client_sequence_does_not_depend_on_the_node_ids():
    """Three launches (three node-id draws) of one config sample the same partitions every round;
    by node id (Flower 1.41's own sampling) they agree in no round."""
    runs = [partitions_sampled(strategy(), simulation_grid(20, launch)) for launch in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert all(len(sample) == 5 and len(set(sample)) == 5 for sample in runs[0])
    assert len({tuple(sample) for sample in runs[0]}) > 20  # rounds differ from each other


def test_two_methods_at_one_seed_see_the_same_clients_and_seeds_differ():
    grid = simulation_grid(20, 0)
    fedact = partitions_sampled(strategy("fedact"), grid)
    assert partitions_sampled(strategy("fedadamw"), simulation_grid(20, 1)) == fedact
    assert partitions_sampled(strategy("fedavg"), simulation_grid(20, 2)) == fedact
    other_seed = partitions_sampled(strategy("fedact", seed=3), grid)
    assert sum(a != b for a, b in zip(fedact, other_seed)) > 20


def test_evaluation_sampling_does_not_shift_the_training_sequence():
    grid = simulation_grid(20, 0)
    alone = partitions_sampled(strategy(), grid)
    with_eval = strategy(fraction_evaluate=0.5)
    trained = []
    for r in ROUNDS:  # evaluation sampled between the training samples, as the round loop does
        trained.append([grid.node_configs[n]["partition-id"] for n in with_eval.sample_nodes(grid, 0.25, 2, r, "train")])
        with_eval.sample_nodes(grid, 0.5, 1, r, "evaluate")
    assert trained == alone


def test_each_node_is_asked_once():
    grid = simulation_grid(20, 0)
    s = strategy()
    partitions_sampled(s, grid)
    assert grid.queries == 20


def test_nodes_with_their_own_data_are_sampled_by_client_name_then_data_path():
    configs = {901: {"data-path": "/data/b", "client-name": "zurich"},
               55: {"data-path": "/data/a"}, 7: {"data-path": "/data/c", "client-name": "basel"}}
    assert client_identity(configs[55]) == {"client-name": "/data/a"}
    renumbered = dict(zip((3, 2, 1), configs.values()))
    s1, s2 = strategy(fraction_train=0.67, num_clients=3), strategy(fraction_train=0.67, num_clients=3)
    names = lambda s, grid: [[client_identity(grid.node_configs[n])["client-name"]
                              for n in s.sample_nodes(grid, 0.67, 2, r, "train")] for r in ROUNDS]
    assert names(s1, QueryGrid(configs)) == names(s2, QueryGrid(renumbered))


def test_a_node_that_cannot_identify_itself_is_sampled_last_and_warned_of(caplog):
    configs = {10: {"partition-id": 0, "num-partitions": 3}, 11: {}, 12: {"partition-id": 1, "num-partitions": 3}}
    s = strategy(fraction_train=1.0, num_clients=3)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        nodes = s.sample_nodes(QueryGrid(configs), 1.0, 2, 1, "train")
    assert nodes == [10, 12, 11]  # identity order; the unidentified node after the others
    assert "node 11 could not say which client it is" in caplog.text and "partition-id=<i>" in caplog.text


def test_two_nodes_with_one_partition_are_warned_of_once(caplog):
    configs = {10: {"partition-id": 0, "num-partitions": 2}, 11: {"partition-id": 0, "num-partitions": 2}}
    s = strategy(fraction_train=1.0, num_clients=2)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.sample_nodes(QueryGrid(configs), 1.0, 2, 1, "train")
        s.sample_nodes(QueryGrid(configs), 1.0, 2, 2, "train")
    assert caplog.text.count("nodes 10, 11 are all partition-id=0") == 1


@pytest.mark.parametrize("identity", [{}, {"partition-id": -1}, {"partition-id": True}, {"client-name": ""},
                                      {"partition-id": "3"}])
def test_malformed_identities_are_refused(identity):
    with pytest.raises(ValueError, match="an identity needs"):
        client_key(identity)


def test_sample_clients_draws_a_subset_of_the_sorted_keys_by_round():
    keys = [(0, i, "") for i in range(10)]
    draws = [sample_clients(keys[::-1], 4, seed=1, server_round=r, purpose="train") for r in range(1, 6)]
    assert all(len(set(d)) == 4 and set(d) <= set(keys) for d in draws)
    assert draws == [sample_clients(keys, 4, seed=1, server_round=r, purpose="train") for r in range(1, 6)]
    assert draws != [sample_clients(keys, 4, seed=1, server_round=r, purpose="evaluate") for r in range(1, 6)]
    assert (sample_count(20, 0.25, 2), sample_count(20, 0.05, 2), sample_count(3, 1.0, 5)) == (5, 2, 3)


def test_a_resumed_run_samples_what_the_straight_run_samples():
    """Round r's sample depends on no earlier round: a strategy that starts at round 3 (a resume,
    which restores no sampler state) draws what one that ran rounds 1-2 draws."""
    straight = partitions_sampled(strategy(), simulation_grid(20, 0))
    resumed = strategy()
    grid = simulation_grid(20, 7)
    assert [[grid.node_configs[n]["partition-id"] for n in resumed.sample_nodes(grid, 0.25, 2, r, "train")]
            for r in ROUNDS[2:]] == straight[2:]


def test_a_silent_node_is_left_out_and_asked_only_once(caplog):
    """The first identification waits up to node_wait_timeout; a node that never answers is left
    out of the sample (warned of), and its open query is collected, not sent again, later."""
    configs = {10 + i: {"partition-id": i, "num-partitions": 4} for i in range(4)}
    grid = QueryGrid(configs, silent={12})
    s = strategy(fraction_train=1.0, num_clients=4, node_wait_timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        first = s.sample_nodes(grid, 1.0, 2, 1, "train")
        second = s.sample_nodes(grid, 1.0, 2, 2, "train")
    assert first == second == [10, 11, 13]
    assert grid.queries == 4 and "1 of 4 nodes did not say which client they are" in caplog.text
    grid.silent.clear()  # its answer arrives: collected at the next sample, without a new query
    assert s.sample_nodes(grid, 1.0, 2, 3, "train") == [10, 11, 12, 13] and grid.queries == 4
