"""The experiment worlds beside the demo's toy shop (world.py), each chosen by the config's `world`.

    uncertain.py  `world: uncertain`: the toy shop with stale logs for some items
    choice.py     `world: choice`: buy the cheapest option with one real call
"""
