import cProfile, pstats, sys
sys.argv = ["x", "1"]
exec(open('docs/measurements/split.py').read().split("acc = ")[0])
mode = sys.argv[-1] if len(sys.argv) > 2 else "rehearse"
sample_episodes(model, tok, prompts, "real", generator=torch.Generator().manual_seed(0), **kw)
cProfile.run('for i in range(3): sample_episodes(model, tok, prompts, "real", generator=torch.Generator().manual_seed(i), **kw)', '/tmp/p4.out')
st = pstats.Stats('/tmp/p4.out'); st.sort_stats('tottime').print_stats(30)
st.sort_stats('cumtime').print_stats(40)
