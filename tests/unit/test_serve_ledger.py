"""The devices a study's trials through Serve hold (device_ledger.py), without Ray: first come, first served,
never more than the capacity, and a trial larger than the cluster runs alone."""

import asyncio

from servetune.device_ledger import DeviceLedger


def run(coro):
    return asyncio.run(coro)


async def started(coro):
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)
    return task


def test_trials_wait_for_devices_in_arrival_order_and_never_hold_more_than_there_are():
    async def scenario():
        ledger = DeviceLedger(4)
        assert await ledger.take("a", 2) == 2 and await ledger.take("b", 1) == 1
        big = await started(ledger.take("c", 2))  # 1 free: waits
        small = await started(ledger.take("d", 1))  # 1 free, but c came first: waits behind it
        assert not big.done() and not small.done()
        assert (await ledger.state())["waiting"] == ["c", "d"]
        assert await ledger.give_back("b") == 1  # 2 free: c takes both, d still waits
        await asyncio.sleep(0.01)
        assert big.done() and not small.done()
        await ledger.give_back("a")
        await asyncio.sleep(0.01)
        assert small.done()
        state = await ledger.state()
        assert state["held"] == {"c": 2, "d": 1} and state["waiting"] == [] and ledger.free() == 1

    run(scenario())


def test_giving_back_what_is_not_held_frees_nothing_and_a_holder_asking_again_keeps_its_share():
    async def scenario():
        ledger = DeviceLedger(2)
        assert await ledger.give_back("nobody") == 0
        assert await ledger.take("a", 1) == 1 and await ledger.take("a", 1) == 1  # a retried call, not two shares
        assert ledger.free() == 1
        # The driver gave back a killed trial whose call had not come in yet: when it comes, it takes nothing.
        assert await ledger.take("nobody", 1) == 0 and ledger.free() == 1

    run(scenario())


def test_a_trial_larger_than_the_cluster_waits_until_nothing_is_held_and_then_runs_alone():
    async def scenario():
        ledger = DeviceLedger(2)
        assert await ledger.take("small", 1) == 1
        big = await started(ledger.take("big", 5))  # more than the cluster: it holds what it asked, alone
        behind = await started(ledger.take("after", 1))
        assert not big.done()
        await ledger.give_back("small")
        assert await asyncio.wait_for(big, 5) == 5 and not behind.done()
        await ledger.give_back("big")
        assert await asyncio.wait_for(behind, 5) == 1
        assert await DeviceLedger(3).take("none", 0) == 0

    run(scenario())


def test_a_trial_stopped_while_it_waits_leaves_the_queue():
    async def scenario():
        ledger = DeviceLedger(1)
        await ledger.take("a", 1)
        waiting = await started(ledger.take("b", 1))
        later = await started(ledger.take("c", 1))
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert (await ledger.state())["waiting"] == ["c"]
        await ledger.give_back("a")
        await asyncio.sleep(0.01)
        assert later.done() and (await ledger.state())["held"] == {"c": 1}

    run(scenario())


def test_a_trial_given_back_while_it_waits_takes_nothing_and_stops_holding_up_the_queue():
    """Its process died while it waited (Ray does not stop the ledger's call): the driver gives it back."""

    async def scenario():
        ledger = DeviceLedger(2)
        await ledger.take("a", 2)
        dead = await started(ledger.take("dead", 2))
        behind = await started(ledger.take("b", 1))
        assert await ledger.give_back("dead") == 0
        await asyncio.sleep(0.01)
        assert dead.done() and dead.result() == 0 and not behind.done()  # b still waits for a, not for dead
        await ledger.give_back("a")
        await asyncio.sleep(0.01)
        assert behind.done() and (await ledger.state())["held"] == {"b": 1} and (await ledger.state())["waiting"] == []

    run(scenario())


def test_while_trials_wait_the_clusters_devices_are_counted_again():
    """An autoscaler adds a node (the trial waiting takes its devices), a node is lost (no more is handed out)."""
    nodes = {"devices": 1}

    def count():
        if nodes["devices"] is None:
            raise RuntimeError("the GCS did not answer")
        return nodes["devices"]

    async def scenario():
        ledger = DeviceLedger(1, count, every_s=0.02)
        assert await ledger.take("a", 1) == 1
        nodes["devices"] = None  # unreadable: the last count stands
        waiting = await started(ledger.take("b", 2))
        await asyncio.sleep(0.1)
        assert not waiting.done() and ledger.capacity == 1 and ledger.counts == 0
        nodes["devices"] = 3  # a node with 2 more joined
        assert await asyncio.wait_for(waiting, 5) == 2 and ledger.free() == 0
        nodes["devices"] = 2  # a node was lost: over-committed, so the next one waits
        late = await started(ledger.take("c", 1))
        await asyncio.sleep(0.1)
        assert not late.done() and ledger.capacity == 2
        await ledger.give_back("a")
        await asyncio.sleep(0.05)
        assert not late.done()  # b's 2 fill the 2 left
        await ledger.give_back("b")
        assert await asyncio.wait_for(late, 5) == 1

    run(scenario())


def test_a_recount_is_not_put_off_by_a_busy_ledger():
    """Trials coming and going every few milliseconds do not keep the waiting one from seeing a new node."""
    nodes = {"devices": 1}

    async def scenario():
        ledger = DeviceLedger(1, lambda: nodes["devices"], every_s=0.05)
        await ledger.take("a", 1)
        waiting = await started(ledger.take("b", 2))
        nodes["devices"] = 3
        for i in range(30):  # a notification every 10 ms, shorter than the count's period
            await ledger.give_back(f"nobody-{i}")
            await asyncio.sleep(0.01)
            if waiting.done():
                break
        assert waiting.done() and waiting.result() == 2

    run(scenario())


def test_a_replica_waits_for_one_node_with_room_even_when_the_cluster_has_enough_devices_in_all():
    """Two 4-device nodes with 3 held on each: 2 are free, but a TP2 replica needs both on one node."""

    async def scenario():
        ledger = DeviceLedger({"a": 4, "b": 4})
        assert await ledger.take("t1", 3, each=3) == 3 and await ledger.take("t2", 3, each=3) == 3
        assert (await ledger.state())["placed"] == {"t1": {"a": 3}, "t2": {"b": 3}} and ledger.free() == 2
        tp2 = await started(ledger.take("tp2", 2, each=2))
        ones = await started(ledger.take("ones", 2, each=1))  # two 1-device replicas would fit, but it came later
        await asyncio.sleep(0.05)
        assert not tp2.done() and not ones.done()
        await ledger.give_back("t1")  # node a is empty: tp2 goes there, then the two ones fill b's 1 and a's 2
        assert await asyncio.wait_for(tp2, 5) == 2 and await asyncio.wait_for(ones, 5) == 2
        placed = (await ledger.state())["placed"]
        assert (
            placed["tp2"] == {"a": 2}
            and placed["ones"] == {"a": 1, "b": 1}
            and ledger.free_by_node() == {"a": 1, "b": 0}
        )

    run(scenario())


def test_replicas_go_to_the_fullest_node_that_fits_so_a_whole_node_is_left_for_a_large_one():
    async def scenario():
        ledger = DeviceLedger({"a": 8, "b": 8})
        assert await ledger.take("x", 2, each=2) == 2 and await ledger.take("y", 4, each=2) == 4
        assert (await ledger.state())["placed"] == {"x": {"a": 2}, "y": {"a": 4}}
        # Spread over both nodes, the TP8 replica would have waited for one of them.
        assert await asyncio.wait_for(ledger.take("tp8", 8, each=8), 1) == 8
        assert (await ledger.state())["placed"]["tp8"] == {"b": 8}

    run(scenario())


def test_a_lost_node_takes_its_devices_with_it_and_a_new_one_is_placed_on():
    nodes = {"a": 4, "b": 4}

    async def scenario():
        ledger = DeviceLedger(dict(nodes), lambda: dict(nodes), every_s=0.02)
        assert await ledger.take("on-a", 4, each=4) == 4 and await ledger.take("on-b", 2, each=2) == 2
        del nodes["b"]  # b is lost (with on-b's replica): a is full, so the next one waits
        await asyncio.sleep(0.05)
        waiting = await started(ledger.take("next", 2, each=2))
        await asyncio.sleep(0.1)
        assert not waiting.done() and ledger.capacity == 4
        nodes["c"] = 2  # the autoscaler's new node: Serve starts on-b's lost replica there first
        await asyncio.sleep(0.1)
        assert not waiting.done() and (await ledger.state())["placed"]["on-b"] == {"c": 2}
        await ledger.give_back("on-b")
        assert await asyncio.wait_for(waiting, 5) == 2 and (await ledger.state())["placed"]["next"] == {"c": 2}

    run(scenario())


def test_a_replica_on_a_lost_node_is_planned_where_serve_starts_it_again_before_a_newcomer_is_let_in():
    nodes = {"a": 4, "b": 4}

    async def scenario():
        ledger = DeviceLedger(dict(nodes), lambda: dict(nodes), every_s=0.02)
        assert await ledger.take("t1", 4, each=2) == 4 and await ledger.take("t2", 2, each=2) == 2
        assert (await ledger.state())["placed"] == {"t1": {"a": 4}, "t2": {"b": 2}}
        del nodes["a"]  # t1's two replicas are started again on b: only one fits there, so t1's plan stays
        await asyncio.sleep(0.05)
        late = await started(ledger.take("t3", 2, each=2))
        await asyncio.sleep(0.1)
        assert late.done()  # b's last 2 (t1's lost replicas fit nowhere whole)
        await ledger.give_back("t3")
        nodes["c"] = 2  # a new node: t1's replicas are planned on b's 2 free and on c, so t4 waits for them
        await asyncio.sleep(0.05)
        t4 = await started(ledger.take("t4", 2, each=2))
        await asyncio.sleep(0.1)
        assert not t4.done() and (await ledger.state())["placed"]["t1"] == {"b": 2, "c": 2}
        await ledger.give_back("t2")
        assert await asyncio.wait_for(t4, 5) == 2 and (await ledger.state())["placed"]["t4"] == {"b": 2}

    run(scenario())


def test_devices_that_are_not_a_multiple_of_a_replica_are_a_smaller_last_replica():
    async def scenario():
        ledger = DeviceLedger({"a": 5})
        assert await asyncio.wait_for(ledger.take("x", 5, each=2), 1) == 5 and ledger.free() == 0

    run(scenario())


def test_where_ray_placed_the_replicas_replaces_the_plan_and_a_waiting_trial_is_judged_by_it():
    async def scenario():
        ledger = DeviceLedger({"a": 4, "b": 2})
        assert await ledger.take("tp2", 2, 2) == 2
        assert (await ledger.state())["placed"]["tp2"] == {"b": 2}  # the plan: the fullest node that fits
        tp4 = await started(ledger.take("tp4", 4, 4))  # a has 4 free by the plan: admitted at once
        assert tp4.done()
        await ledger.give_back("tp4")
        # Ray put the TP2 replica on a (it weighs CPUs and memory too): a TP4 now fits nowhere.
        assert await ledger.placed_at("tp2", {"a": 2}) == {"a": 2}
        assert ledger.free_by_node() == {"a": 2, "b": 2}
        late = await started(ledger.take("tp4-late", 4, 4))
        assert not late.done()
        # Ray moves it (a replica replaced on b): the TP4 that waited is let in on a.
        assert await ledger.placed_at("tp2", {"b": 2}) == {"b": 2}
        await asyncio.sleep(0.01)
        assert late.done() and (await ledger.state())["placed"]["tp4-late"] == {"a": 4}

    run(scenario())


def test_a_placement_read_before_every_replica_is_placed_or_for_a_holder_that_holds_nothing_changes_nothing():
    async def scenario():
        ledger = DeviceLedger({"a": 2, "b": 2})
        assert await ledger.take("two", 2, 1) == 2
        plan = (await ledger.state())["placed"]["two"]
        assert await ledger.placed_at("two", {"b": 1}) is None  # one of two devices placed so far: the plan stands
        assert (await ledger.state())["placed"]["two"] == plan
        assert await ledger.placed_at("two", {"a": 1, "b": 1}) == {"a": 1, "b": 1}
        assert await ledger.placed_at("gone", {"a": 1}) is None and "gone" not in (await ledger.state())["placed"]

    run(scenario())


def test_a_replica_stretched_over_two_nodes_is_held_on_both_and_one_the_count_cannot_hold_or_running_alone_keeps_the_plan():
    async def scenario():
        ledger = DeviceLedger({"a": 2, "b": 4})
        assert await ledger.take("tp4", 4, 4) == 4
        assert (await ledger.state())["placed"]["tp4"] == {"b": 4}
        # More on a than it has (a node the count does not know yet, or a wrong read): the plan stands.
        assert await ledger.placed_at("tp4", {"a": 4}) is None
        assert (await ledger.state())["placed"]["tp4"] == {"b": 4}
        # Ray Serve LLM's PACK stretched it over both nodes (its bundles read node by node): held on both.
        assert await ledger.placed_at("tp4", {"a": 1, "b": 3}) == {"a": 1, "b": 3}
        assert ledger.free_by_node() == {"a": 1, "b": 1}
        await ledger.give_back("tp4")
        assert await ledger.take("tp8", 8, 8) == 8  # larger than any node: runs alone, unplanned
        assert await ledger.placed_at("tp8", {"a": 2, "b": 4}) is None
        assert (await ledger.state())["placed"]["tp8"] == {"": 8} and ledger.free() == 0

    run(scenario())
