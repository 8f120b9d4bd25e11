//! The random causal graph of a synthetic table: a growing network with redirection
//! (Krapivsky & Redner 2001), the graph family TabPFN v2's prior draws its structural causal
//! models from (Hollmann et al. 2025, Nature, "Accurate predictions on small data with a tabular
//! foundation model", Methods), with extra parents by preferential attachment so nodes can have
//! several causes.

use super::stream::Stream;

/// Nodes in topological order: every parent of node `i` is below `i`.
pub struct CausalGraph {
    pub parents: Vec<Vec<usize>>,
}

impl CausalGraph {
    /// `n` nodes of which the first `roots` have no cause; each later node attaches to a uniformly chosen earlier node, redirected with
    /// probability `redirect` to that node's first parent; then with probability `extra` per
    /// node one more parent, chosen in proportion to degree.
    pub fn sample(rng: &mut Stream, n: usize, roots: usize, redirect: f64, extra: f64) -> Self {
        let roots = roots.clamp(1, n);
        let mut parents: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut degree = vec![1usize; n];
        for i in roots..n {
            let mut p = rng.below(i);
            if rng.chance(redirect) {
                if let Some(&gp) = parents[p].first() {
                    p = gp;
                }
            }
            parents[i].push(p);
            degree[p] += 1;
            degree[i] += 1;
            if i > 1 && rng.chance(extra) {
                let total: usize = degree[..i].iter().sum();
                let mut pick = rng.below(total);
                let q = (0..i)
                    .find(|&j| {
                        if pick < degree[j] {
                            true
                        } else {
                            pick -= degree[j];
                            false
                        }
                    })
                    .unwrap_or(0);
                if !parents[i].contains(&q) {
                    parents[i].push(q);
                    degree[q] += 1;
                    degree[i] += 1;
                }
            }
        }
        CausalGraph { parents }
    }

    pub fn is_root(&self, i: usize) -> bool {
        self.parents[i].is_empty()
    }

    /// Hops from `from` to every node with edges taken either way (`usize::MAX` where none
    /// leads): how near a feature's node is to the target's, cause or effect.
    pub fn distances_from(&self, from: usize) -> Vec<usize> {
        let n = self.parents.len();
        let mut children = vec![Vec::new(); n];
        for (c, ps) in self.parents.iter().enumerate() {
            for &p in ps {
                children[p].push(c);
            }
        }
        let mut dist = vec![usize::MAX; n];
        dist[from] = 0;
        let mut queue = std::collections::VecDeque::from([from]);
        while let Some(i) = queue.pop_front() {
            for &j in self.parents[i].iter().chain(&children[i]) {
                if dist[j] == usize::MAX {
                    dist[j] = dist[i] + 1;
                    queue.push_back(j);
                }
            }
        }
        dist
    }
}
