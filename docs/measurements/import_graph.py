import ast, glob, os, sys
root = sys.argv[1] if len(sys.argv) > 1 else "."
mods = {os.path.basename(f)[:-3]: f for f in glob.glob(os.path.join(root, "*.py"))}
graph = {}
for m, f in mods.items():
    deps = set()
    tree = ast.parse(open(f).read())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            deps |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            deps.add(n.module.split(".")[0])
    graph[m] = sorted(d for d in deps if d in mods and d != m)
cycles = []
def dfs(start, node, path, seen):
    for d in graph[node]:
        if d == start:
            cycles.append(path + [d])
        elif d not in seen and d > start:
            seen.add(d); dfs(start, d, path + [d], seen)
for m in sorted(graph):
    dfs(m, m, [m], {m})
for m in sorted(graph):
    print(f"{m} -> {', '.join(graph[m])}")
print("cycles:", cycles or "none")
